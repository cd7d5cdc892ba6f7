"""Every documented promise seen from outside, on the server `make serve` runs (issue 27).

Two tables: every variable of docs/configuration.md (variable, value, what a client or an
operator sees), and every metric family /metrics exposes (metric, the event that moves it,
its value after). Each row's variable is set in the environment of a real gunicorn started
by tools/server.py with gunicorn.conf.py; rows that can share a server do (a group), and a
group's server starts once, when its first row runs. A variable documented without a row,
or a metric family exposed without one, fails the coverage tests.

Expected values are literals taken from the docs (limits, details, formulas), never the
code's constants. Waits are bounded (WAIT_S) and count events (a gauge reaching a value, a
socket closing). Two rows compare a time, each with the documented default as the bound (the
keep-alive, 75 s, for a value of 1 s; the send timeout, 30 s, for 1 s): a timeout's effect is a
time, and no busy machine stretches 1 s to the default. The lease row reads the lease's end in
the store against now + 2 s: renewed before it is read, it cannot end later on any machine.
A row that needs a job running holds its tiles at their start on the embedded cluster's worker
(tests/dask_cluster.py HeldTiles) and releases them one at a time, so each look sees a known
state; a job's end that the TTL would hide is seen in the runner's log line, and its rows in
the store itself (the jobs server's SQLite file; the ttl server's PostgreSQL database, from
tests/postgres.py's server).
"""
import contextlib
import io
import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.dask_cluster import HeldTiles, cluster_client, cluster_tls_env, dask_role, has_task
from tests.events import LISTEN, socket_inodes
from tests.numeric import assert_matches
from tests.oracle import expected, oracle
from tests.otlp_receiver import GrpcReceiver, Receiver
from tools.server import ROOT, children, gunicorn_command, gunicorn_server, is_dask_process, wait_until

pytestmark = pytest.mark.slow

WAIT_S = 90  # generous bound of every wait: the machine may be slow and shared
TOKEN = "open-sesame"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
DOCS = ROOT / "docs"
# Pin the cost model where a request must be admitted whatever it computes (docs/performance.md).
CHEAP = {"BLOCKGRAD_COST_PER_BLOCK_S": "1e-12", "BLOCKGRAD_COST_PER_NUMBER_S": "1e-12"}


# --- talking to a server


def post(server, path: str, body, headers: dict | None = None, **kwargs) -> requests.Response:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return requests.post(server.url + path, data=data, timeout=WAIT_S,
                         headers={"Content-Type": "application/json", **(headers or {})}, **kwargs)


def error_of(response: requests.Response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text[:2000]
    error = response.json()["error"]
    assert error["code"] == code, error
    return error


def scrape(server) -> dict[tuple[str, frozenset], float]:
    """Every sample of /metrics; the scrape's own connection is closed by the server (`served`)."""
    response = requests.get(server.url + "/metrics", timeout=WAIT_S, headers={"Connection": "close"})
    assert response.status_code == 200
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(response.text) for sample in family.samples}


def families(server) -> set[str]:
    response = requests.get(server.url + "/metrics", timeout=WAIT_S, headers={"Connection": "close"})
    return {family.name for family in text_string_to_metric_families(response.text)}


def value(samples, name: str, **labels) -> float:
    return samples.get((name, frozenset((k, str(v)) for k, v in labels.items())), 0.0)


def summed(samples, name: str, **labels) -> float:
    """The sum over every sample of `name` whose labels include `labels` (e.g. over pids)."""
    want = {(k, str(v)) for k, v in labels.items()}
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    assert wait_until(predicate, timeout_s, 0.1), f"not within {timeout_s} s: {what}"


def wait_for_metric(server, name: str, expected: float, **labels) -> dict:
    """Scrape until `name{labels}` reads `expected` (bounded); the last scrape."""
    seen = {}

    def reached():
        seen["samples"] = scrape(server)
        return value(seen["samples"], name, **labels) == expected
    wait_for(reached, f"{name}{labels} == {expected} (last {value(seen.get('samples', {}), name, **labels)})")
    return seen["samples"]


def connect(server, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(WAIT_S)
    sock.connect(("127.0.0.1", server.port))
    return sock


def head(method: str, path: str, headers: dict | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def read_answer(sock: socket.socket) -> tuple[int, dict, bytes]:
    """One HTTP/1.1 answer with a Content-Length, read off `sock` (left open)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a whole head: {data!r}"
        data += chunk
    raw, body = data.split(b"\r\n\r\n", 1)
    status_line, *header_lines = raw.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in header_lines)}
    length = int(headers.get("content-length", 0))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "closed before the whole body"
        body += chunk
    return int(status_line.split()[1]), headers, body


def read_to_eof(sock: socket.socket) -> bytes:
    """Everything until the server closes (bounded by the socket's timeout)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True


def log_lines(server) -> list[dict]:
    lines = []
    for line in server.log().splitlines():
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            if isinstance(entry, dict):
                lines.append(entry)
    return lines


def request_line(server, request_id: str) -> dict | None:
    return next((e for e in log_lines(server) if e.get("request_id") == request_id and e.get("message") == "request"),
                None)


def vectors(n: int, dim: int) -> list[list[float]]:
    return [[0.25 * (i + 1) + 0.125 * j for j in range(dim)] for i in range(n)]


def gradients(n: int, dim: int, factor: int, outputs=("accumulated",), **extra) -> dict:
    return {"vectors": vectors(n, dim), "factor": factor, "outputs": list(outputs), "objective": "sum",
            "dtype": "float64", **extra}


# --- servers, one per group of compatible settings


def export_model(directory: Path) -> None:
    """One small exported objective, `pairmlp` (D=2, float32), as docs/models.md describes."""
    import torch
    from torch.export import Dim
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).eval()
    program = torch.export.export(module, (torch.randn(5, 4),), dynamic_shapes=({0: Dim("pairs")},))
    torch.export.save(program, str(directory / "pairmlp.pt2"))


@dataclass
class Group:
    """A server's settings beside its rows' variables. `cpus`: the CPUs it may use (its
    compute slots then are a known literal)."""
    workers: int | None = 1
    env: dict = field(default_factory=dict)
    cpus: int | None = None


GROUPS = {
    # Small limits, a token, a model directory; head and read timeouts long, so that eviction
    # (not the header timeout) closes the oldest of a few silent connections.
    "limits": Group(env={"BLOCKGRAD_HEADER_TIMEOUT_S": "120", "BLOCKGRAD_READ_TIMEOUT_S": "120"}),
    "timeouts": Group(workers=None, env=CHEAP),  # WEB_CONCURRENCY comes from its row
    "cost": Group(),
    "metrics": Group(cpus=1, env={**CHEAP, "BLOCKGRAD_REQUEST_TIMEOUT_S": "600"}),
    # BLOCKGRAD_DASK_SCHEDULER blank: the embedded cluster, as `make serve` starts it, its SQLite
    # store in BLOCKGRAD_DATA_DIR.
    "jobs": Group(),
    # A second server on the jobs server's scheduler, its store a PostgreSQL database of this module.
    "ttl": Group(),
    # The results cap and the records cap, on an embedded cluster with a store of their own.
    "results": Group(env={"BLOCKGRAD_DASK_SCHEDULER": "", "BLOCKGRAD_DASK_WORKERS": "1",
                          "BLOCKGRAD_DATA_DIR": "{tmp}/results-data"}),
}


class Servers:
    """Starts a group's server on first use; all stopped together when the module ends."""

    def __init__(self, tmp: Path, request):
        self.tmp, self.started, self.managers = tmp, {}, []
        self.observed: dict = {}  # observations several rows read (e.g. a held slot's scrapes)
        self.request, self.database, self.engine = request, None, None
        self.receivers: dict = {}  # OTLP receivers by protocol, started on first use

    def postgres(self) -> str:
        """A PostgreSQL database of this module (tests/postgres.py's server, started on first use)."""
        if self.database is None:
            from tests.postgres import new_database

            self.database = new_database(self.request.getfixturevalue("postgres_server"), "promises")
            self.database_url = self.database.__enter__()
        return self.database_url

    def store(self):
        """An engine on the ttl server's store (the PostgreSQL database)."""
        from app.jobs import db

        if self.engine is None:
            self.engine = db.open_store(self.postgres())
        return self.engine

    def __getitem__(self, group: str):
        if group not in self.started:
            self.started[group] = self.start(group)
        return self.started[group]

    def env_of(self, group: str) -> dict[str, str]:
        env = {name: value.format(tmp=self.tmp) for name, value in GROUPS[group].env.items()}
        for row in VARIABLES:
            if row.group == group and row.sets:
                env[row.variable] = row.value.format(tmp=self.tmp, group=group, otlp=self.OtlpEndpoints(self))
        return env

    def otlp(self, protocol: str):
        """The module's OTLP receiver over `protocol` (http or grpc), started on first use."""
        if protocol not in self.receivers:
            self.receivers[protocol] = Receiver() if protocol == "http" else GrpcReceiver()
        return self.receivers[protocol]

    class OtlpEndpoints:
        """`{otlp[http]}` in a row's value: that receiver's endpoint (it starts when a server needs it)."""

        def __init__(self, servers):
            self.servers = servers

        def __getitem__(self, protocol: str) -> str:
            return self.servers.otlp(protocol).endpoint

    def start(self, group: str):
        spec, env = GROUPS[group], self.env_of(group)
        if "BLOCKGRAD_MODEL_DIR" in env:
            Path(env["BLOCKGRAD_MODEL_DIR"]).mkdir(parents=True, exist_ok=True)
            export_model(Path(env["BLOCKGRAD_MODEL_DIR"]))
        if "PROMETHEUS_MULTIPROC_DIR" in env:  # a stale file that the start must remove
            Path(env["PROMETHEUS_MULTIPROC_DIR"]).mkdir(parents=True, exist_ok=True)
            (Path(env["PROMETHEUS_MULTIPROC_DIR"]) / "counter_999999.db").write_bytes(b"stale")
        if group == "ttl":  # an external scheduler needs a shared store
            env["BLOCKGRAD_DASK_SCHEDULER"] = jobs_scheduler(self)
            env.update(cluster_tls_env(env["BLOCKGRAD_DASK_SCHEDULER"]))  # its TLS, as Dask configuration
            env["BLOCKGRAD_JOBS_DB"] = self.postgres()
        workers = int(env.pop("WEB_CONCURRENCY")) if "WEB_CONCURRENCY" in env else spec.workers
        manager = gunicorn_server(workers=workers, env=env)
        mask = os.sched_getaffinity(0)
        os.sched_setaffinity(0, sorted(mask)[:spec.cpus or len(mask)])  # inherited by gunicorn and its workers
        try:
            server = manager.__enter__()
            self.managers.append(manager)
        finally:
            os.sched_setaffinity(0, mask)
        if env.get("BLOCKGRAD_DASK_SCHEDULER", "off") != "off":  # the cluster's workers join after the start
            wait_for(lambda: value(scrape(server), "blockgrad_cluster_workers") >= 1, "a Dask worker joined")
        return server


    def stop(self) -> None:
        """Each server stops in its own thread: a stop may wait seconds for its workers."""
        with ThreadPoolExecutor(max(1, len(self.managers))) as pool:
            list(pool.map(lambda manager: manager.__exit__(None, None, None), self.managers))
        if self.engine is not None:
            self.engine.dispose()
        if self.database is not None:
            self.database.__exit__(None, None, None)
        for receiver in self.receivers.values():
            receiver.close()


def jobs_scheduler(servers) -> str:
    """The jobs server's embedded scheduler, as its runner's row in the store names it (/readyz
    names none for an embedded cluster)."""
    servers["jobs"]
    path = Path(servers.env_of("jobs")["BLOCKGRAD_DATA_DIR"]) / "jobs.sqlite3"
    with contextlib.closing(sqlite3.connect(path)) as conn:
        found = {row[0] for row in conn.execute("SELECT scheduler FROM job_runners")}
    assert len(found) == 1 and next(iter(found)).startswith("tls://127.0.0.1:"), found
    return found.pop()


def jobs_row(servers, job_id: str) -> dict | None:
    """The job's row in the jobs server's SQLite store."""
    path = Path(servers.env_of("jobs")["BLOCKGRAD_DATA_DIR"]) / "jobs.sqlite3"
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.row_factory = sqlite3.Row
        row = conn.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
    return None if row is None else dict(row)


@pytest.fixture(scope="module")
def servers(tmp_path_factory, request):
    started = Servers(tmp_path_factory.mktemp("promises"), request)
    try:
        yield started
    finally:
        started.stop()


# --- the variables of docs/configuration.md


@dataclass(frozen=True)
class Var:
    """`variable` set to `value` in `group`'s server; `check(server, servers)` sees its effect.
    A value in parentheses is not set here (tools/server.py sets it, or it is the default)."""
    variable: str
    value: str
    group: str
    effect: str
    check: Callable

    @property
    def sets(self) -> bool:
        return not self.value.startswith("(")


def check_bind(server, servers):
    assert socket_inodes(server.port, state=LISTEN), "nothing listens on BLOCKGRAD_BIND's port"
    assert requests.get(f"http://127.0.0.1:{server.port}/healthz", timeout=WAIT_S).json() == {"status": "ok"}


def grpc_stub(server):
    """The server's GRPCInferenceService (imported here: grpcio is a runtime dependency only the gRPC rows use)."""
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    channel = grpc.insecure_channel(server.grpc_target)
    return channel, service_pb2_grpc.GRPCInferenceServiceStub(channel)


def check_grpc_bind(server, servers):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from tritonclient.grpc import service_pb2

    channel, stub = grpc_stub(server)  # server.grpc_target: the port tools/server.py set in BLOCKGRAD_GRPC_BIND
    with channel:
        assert stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=WAIT_S).live
        check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=WAIT_S)
        assert check.status == health_pb2.HealthCheckResponse.SERVING


def check_grpc_message_limit(server, servers):
    import grpc
    from tritonclient.grpc import service_pb2

    def infer(n: int, dim: int, *outputs: str):
        message = service_pb2.ModelInferRequest(model_name="blockgrad")
        message.inputs.add(name="vectors", datatype="FP32", shape=[n, dim])
        message.raw_input_contents.append(np.ones((n, dim), np.float32).tobytes())
        for name in outputs:
            message.outputs.add(name=name)
        try:
            stub.ModelInfer(message, timeout=WAIT_S)
        except grpc.RpcError as error:
            return error
        return None

    channel, stub = grpc_stub(server)
    with channel:
        assert infer(40, 16, "losses") is None  # a 2,560-byte request, a small answer
        refused = infer(40, 16, "block_gradients")  # 40 x 40 x 32 float32: 204,800 bytes
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "over BLOCKGRAD_GRPC_MAX_MESSAGE_BYTES = 100000" in refused.details()
        assert infer(1000, 32, "bounds").code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # a 128,000-byte request


def check_workers(server, servers):
    assert len(server.worker_pids()) == 3


def check_device(server, servers):
    error_of(requests.get(server.url + "/readyz", timeout=WAIT_S), 503, "not_ready")


def check_max_body(server, servers):
    body = json.dumps(gradients(2, 1, 1)).encode().ljust(4097)  # JSON whitespace: one byte over
    error = error_of(post(server, "/v1/gradients", body, AUTH), 413, "too_large")
    assert error["details"]["allowed"] == 4096
    assert post(server, "/v1/gradients", body[:4096], AUTH).status_code == 200


def check_max_n(server, servers):
    error = error_of(post(server, "/v1/gradients", gradients(6, 1, 1), AUTH), 413, "limit_exceeded")
    assert error["details"] == {"limit": "BLOCKGRAD_MAX_N", "value": 6, "allowed": 5}
    assert len(post(server, "/v1/gradients", gradients(5, 1, 5), AUTH).json()["accumulated"]) == 5


def check_max_d(server, servers):
    error = error_of(post(server, "/v1/gradients", gradients(2, 4, 1), AUTH), 413, "limit_exceeded")
    assert error["details"] == {"limit": "BLOCKGRAD_MAX_D", "value": 4, "allowed": 3}


def check_max_output(server, servers):
    # blocks N*N*2D + accumulated N*D + losses F*F = 100 + 10 + 25 (the docs' formula)
    body = gradients(5, 2, 5, outputs=("blocks", "accumulated", "losses"))
    error = error_of(post(server, "/v1/gradients", body, AUTH), 413, "limit_exceeded")
    assert (error["details"]["limit"], error["details"]["value"], error["details"]["allowed"]) == (
        "BLOCKGRAD_MAX_OUTPUT_ELEMENTS", 135, 100)


def check_max_block(server, servers):
    # side * side * 2D = 4 * 4 * 4 with factor 1
    error = error_of(post(server, "/v1/gradients", gradients(4, 2, 1), AUTH), 413, "limit_exceeded")
    details = error["details"]
    assert (details["limit"], details["value"], details["allowed"]) == ("BLOCKGRAD_MAX_BLOCK_ELEMENTS", 64, 32)
    assert details["suggested_factor"] in (2, 3, 4)  # side 2: 16 numbers


def objectives(server) -> dict[str, dict]:
    answer = requests.get(server.url + "/v1/objectives", headers=AUTH, timeout=WAIT_S)
    assert answer.status_code == 200
    return {entry["name"]: entry for entry in answer.json()["objectives"]}


def check_model_dir(server, servers):
    entry = objectives(server)["pairmlp"]
    assert (entry["kind"], entry["dim"], entry["dtypes"]) == ("model", 2, ["float32"])
    answer = post(server, "/v1/gradients", {"vectors": vectors(2, 2), "factor": 2, "objective": "pairmlp",
                                            "dtype": "float32", "outputs": ["losses"]}, AUTH)
    assert answer.status_code == 200 and len(answer.json()["losses"]) == 2


def check_max_activation(server, servers):
    per_pair = objectives(server)["pairmlp"]["bytes_per_pair"]
    assert 4 * per_pair > 300 >= per_pair, per_pair  # 2 x 2 pairs over the limit, one pair within
    body = {"vectors": vectors(4, 2), "factor": 2, "objective": "pairmlp", "dtype": "float32", "outputs": ["losses"]}
    error = error_of(post(server, "/v1/gradients", body, AUTH), 413, "limit_exceeded")
    assert error["details"] == {"limit": "BLOCKGRAD_MAX_ACTIVATION_BYTES", "value": 4 * per_pair, "allowed": 300}
    assert post(server, "/v1/gradients", dict(body, factor=4), AUTH).status_code == 200


def check_token(server, servers):
    refused = requests.get(server.url + "/v1/objectives", timeout=WAIT_S)
    error_of(refused, 401, "unauthorized")
    assert refused.headers["WWW-Authenticate"].startswith("Bearer")
    error_of(requests.get(server.url + "/v1/objectives", headers={"Authorization": "Bearer nope"},
                          timeout=WAIT_S), 401, "unauthorized")
    assert requests.get(server.url + "/v1/objectives", headers=AUTH, timeout=WAIT_S).status_code == 200
    for probe in ("/healthz", "/readyz", "/metrics"):  # open to probes and scrapers (docs/api.md)
        assert requests.get(server.url + probe, timeout=WAIT_S).status_code == 200, probe


def check_docs_private(server, servers):
    for path in ("/openapi.json", "/docs"):
        error_of(requests.get(server.url + path, timeout=WAIT_S), 401, "unauthorized")
        assert requests.get(server.url + path, headers=AUTH, timeout=WAIT_S).status_code == 200


def check_log_warning(server, servers):
    request_id = f"promise-{uuid.uuid4().hex}"
    answer = post(server, "/v1/gradients", gradients(2, 1, 1), {**AUTH, "X-Request-ID": request_id})
    assert answer.status_code == 200 and answer.headers["X-Request-ID"] == request_id
    error_of(post(server, "/v1/gradients", gradients(2, 1, 3), AUTH), 422, "validation_error")
    assert not any(e.get("logger") == "blockgrad.request" for e in log_lines(server)), "a request line at WARNING"


def check_log_info(server, servers):
    """The default level writes the per-request line (the control of the row above)."""
    request_id = f"promise-{uuid.uuid4().hex}"
    assert post(server, "/v1/gradients", gradients(2, 1, 1), {"X-Request-ID": request_id}).status_code == 200
    wait_for(lambda: request_line(server, request_id) is not None, "the request's log line")
    line = request_line(server, request_id)
    assert (line["status"], line["n"], line["dim"], line["factor"]) == (200, 2, 1, 1)


def check_metrics_dir(server, servers):
    directory = Path(servers.env_of("limits")["PROMETHEUS_MULTIPROC_DIR"])
    assert requests.get(server.url + "/healthz", timeout=WAIT_S).status_code == 200
    names = {path.name for path in directory.iterdir()}
    assert "counter_999999.db" not in names, "the stale file survived the start"
    assert any(name.startswith("counter_") for name in names), names  # the workers' values live there


def check_max_connections(server, servers):
    assert "workers x BLOCKGRAD_MAX_CONNECTIONS = 3 hold fewer than" in server.log()
    before = scrape(server)
    with contextlib.ExitStack() as stack:
        first = stack.enter_context(connect(server))
        wait_for(lambda: value(scrape(server), "blockgrad_connections_awaiting_head") >= 1, "the first accepted")
        for _ in range(3):  # 4 silent connections and the scrape's: over 3, the longest waiting goes
            stack.enter_context(connect(server))
        assert closed_by_server(first)
        after = scrape(server)
    evicted = value(after, "blockgrad_connections_closed_total", reason="evicted")
    assert evicted >= value(before, "blockgrad_connections_closed_total", reason="evicted") + 1


def check_header_timeout(server, servers):
    with connect(server) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finished
        answer = read_to_eof(sock)
    head_bytes, body = answer.split(b"\r\n\r\n", 1)
    assert head_bytes.startswith(b"HTTP/1.1 408")
    assert json.loads(body)["error"]["details"] == {"timeout_s": 1}


def check_read_timeout(server, servers):
    with connect(server) as sock:
        sock.sendall(head("POST", "/v1/gradients", {"Content-Type": "application/json", "Content-Length": "100"})
                     + b'{"vectors": ')
        answer = read_to_eof(sock)
    head_bytes, body = answer.split(b"\r\n\r\n", 1)
    assert head_bytes.startswith(b"HTTP/1.1 408")
    error = json.loads(body)["error"]
    assert error["code"] == "read_timeout" and "BLOCKGRAD_READ_TIMEOUT_S = 2 s" in error["message"]


def check_keepalive(server, servers):
    """A timeout's effect is a time: the one verdict on a clock here is against the default
    (75 s), 74 s above the value set, so it never depends on how busy the machine is."""
    with connect(server) as sock:
        sock.sendall(head("GET", "/healthz"))
        assert read_answer(sock)[0] == 200
        idle_since = time.monotonic()
        assert closed_by_server(sock), "an idle kept-alive connection stayed open"
        assert time.monotonic() - idle_since < 75, "closed at the default keep-alive, not the one set"


def check_send_timeout(server, servers):
    request_id = f"promise-{uuid.uuid4().hex}"
    body = json.dumps(gradients(96, 32, 1, outputs=("blocks",))).encode()  # ~12 MB of answer, never read
    with connect(server, rcvbuf=4096) as sock:
        sock.sendall(head("POST", "/v1/gradients", {"Content-Type": "application/json", "X-Request-ID": request_id,
                                                    "Content-Length": str(len(body))}) + body)
        wait_for(lambda: request_line(server, request_id) is not None, "the stalled request's log line")
    line = request_line(server, request_id)
    assert (line["status"], line["error"]) == (200, "send_timeout"), line
    assert 1000 <= line["duration_ms"] < 30000, line  # cut at the 1 s set, not at the default 30 s


def held_request(server, n: int = 4096, dim: int = 64) -> socket.socket:
    """A request that computes for minutes (cancelled when its socket closes)."""
    body = json.dumps({"vectors": vectors(n, dim), "factor": 64, "objective": "sum_of_squares",
                       "outputs": ["accumulated"]}).encode()
    sock = connect(server)
    sock.sendall(head("POST", "/v1/gradients", {"Content-Type": "application/json",
                                                "Content-Length": str(len(body))}) + body)
    return sock


SLOT_SCRAPES = 50  # a count of looks, not a time (as tests/test_cores_serving.py's samples)


def check_slots_per_request(server, servers):
    """Once the held request holds its slot, every look sees it hold that one only."""
    with held_request(server):
        wait_for(lambda: value(scrape(server), "blockgrad_compute_slots_busy") >= 1, "the request computing")
        busy = [value(scrape(server), "blockgrad_compute_slots_busy") for _ in range(SLOT_SCRAPES)]
        assert busy == [1] * SLOT_SCRAPES, busy
    wait_for(lambda: value(scrape(server), "blockgrad_compute_slots_busy") == 0, "the slot freed")


def check_cost_per_block(server, servers):
    # time = blocks x per block + numbers x per number, numbers = N*N*2D + F*N*2D (docs/performance.md)
    error = error_of(post(server, "/v1/gradients", gradients(8, 1, 8)), 413, "limit_exceeded")
    details = error["details"]
    assert details["predicted_s"] == pytest.approx(64 * 1.0 + (128 + 128) * 1e-4, abs=1e-3)
    assert details["suggested_factor"] == 1  # 1 + 144e-4 s


def check_cost_per_number(server, servers):
    error = error_of(post(server, "/v1/gradients", gradients(200, 2, 1)), 413, "limit_exceeded")
    assert error["details"]["predicted_s"] == pytest.approx(1.0 + (160000 + 800) * 1e-4, abs=1e-3)


def check_request_timeout(server, servers):
    error = error_of(post(server, "/v1/gradients", gradients(200, 2, 1)), 413, "limit_exceeded")
    details = error["details"]
    assert (details["limit"], details["deadline_s"], details["allowed"]) == ("BLOCKGRAD_REQUEST_TIMEOUT_S", 7, 7)
    assert "suggested_factor" not in details  # factor 2 is slower still


def check_worker_memory(server, servers):
    # 1.008 s by the cost model, but any computing request is predicted over 32 MiB
    error = error_of(post(server, "/v1/gradients", gradients(4, 2, 1)), 413, "limit_exceeded")
    details = error["details"]
    assert (details["limit"], details["allowed"]) == ("BLOCKGRAD_WORKER_MEMORY_BYTES", 33554432)
    assert details["value"] > 33554432


def check_upload_share(server, servers):
    body = json.dumps({"vectors": [[float(i * 40 + j) / 7 for j in range(40)] for i in range(300)],
                       "factor": 3, "outputs": ["accumulated"]})  # ~200 KiB: 2 bytes a byte over 0.002 x 32 MiB
    error = error_of(post(server, "/v1/gradients", body), 413, "limit_exceeded")
    # after its first 64 KiB piece it holds 2 x 65536 bytes, over 0.002 x 33554432 (errors-edge.md)
    assert error["details"] == {"limit": "BLOCKGRAD_UPLOAD_MEMORY_SHARE", "value": 131072, "allowed": 67108}


def hold_slot_and_queue(server):
    """The one compute slot held by one request and one more queued (both counted by the
    gauges), then a third: refused at once. Yields (the scrape with both, the refusal)."""
    with held_request(server):
        wait_for_metric(server, "blockgrad_compute_slots_busy", 1)
        with held_request(server, n=2048):
            held = wait_for_metric(server, "blockgrad_queue_depth", 1)
            yield held, post(server, "/v1/gradients", gradients(4, 2, 1))
    wait_for_metric(server, "blockgrad_compute_slots_busy", 0)
    wait_for_metric(server, "blockgrad_queue_depth", 0)


def check_queue_depth(server, servers):
    for held, third in hold_slot_and_queue(server):
        error = error_of(third, 503, "overloaded")
        assert error["details"] == {"queue_depth": 1} and third.headers["Retry-After"] == "1"


def submit_job(server, body: dict | bytes, query: str = "", content_type: str = "application/json"):
    data = body if isinstance(body, bytes) else json.dumps(body)
    return requests.post(server.url + "/v1/jobs" + query, data=data, timeout=WAIT_S,
                         headers={"Content-Type": content_type})


def job_state(server, job_id: str) -> requests.Response:
    return requests.get(f"{server.url}/v1/jobs/{job_id}", timeout=WAIT_S)


def finished(server, job_id: str) -> dict:
    """The job's record once it has finished (bounded)."""
    seen = {}

    def done():
        seen["record"] = job_state(server, job_id).json()
        return seen["record"].get("status") in ("succeeded", "failed", "cancelled")
    assert wait_until(done, WAIT_S, 0.1), f"not within {WAIT_S} s: job {job_id} finished (last {seen.get('record')})"
    return seen["record"]


def small_job(server, n: int = 1, dim: int = 1, outputs=("losses",)) -> str:
    answer = submit_job(server, {"vectors": vectors(n, dim), "factor": 1, "objective": "sum",
                                 "dtype": "float64", "outputs": list(outputs)})
    assert answer.status_code == 202, answer.text
    return answer.json()["id"]


def npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def supervised(server) -> list[str]:
    """What the server's supervisor runs: "runner", "scheduler", "worker", sorted."""
    [supervisor] = [pid for pid in children(server.pid) if is_dask_process(pid)]
    assert " -m app.jobs.supervisor " in cmdline(supervisor)
    return sorted("runner" if " -m app.jobs.runner" in cmdline(pid) else dask_role(cmdline(pid)) or cmdline(pid)
                  for pid in children(supervisor))


def runner_pid(server) -> int:
    [supervisor] = [pid for pid in children(server.pid) if is_dask_process(pid)]
    [runner] = [pid for pid in children(supervisor) if " -m app.jobs.runner" in cmdline(pid)]
    return runner


def runner_line(server, job_id: str) -> dict:
    """The runner's job_finished log line of the job (bounded wait)."""
    seen = []
    wait_for(lambda: seen.extend(e for e in log_lines(server) if e.get("event") == "job_finished"
                                 and e.get("job") == job_id) or seen, f"the runner's job_finished line of {job_id}")
    return seen[0]


def check_embedded_cluster(server, servers):
    wait_for(lambda: supervised(server) == ["runner", "scheduler", "worker"], "a runner, a scheduler, a worker")
    job_id = small_job(server)
    assert finished(server, job_id)["status"] == "succeeded"
    def cluster():  # from the store's last read, which this /readyz may have just started
        return requests.get(server.url + "/readyz", timeout=WAIT_S).json()["cluster"]
    wait_for(lambda: cluster() == {"store": "sqlite", "reachable": True, "workers": 1}, "/readyz: 1 worker")
    assert jobs_scheduler(servers).startswith("tls://127.0.0.1:")  # its runner's, in the store, not in /readyz
    assert cmdline(runner_pid(server)).split()[-1] == jobs_scheduler(servers)


def check_data_dir(server, servers):
    store = Path(servers.env_of("jobs")["BLOCKGRAD_DATA_DIR"]) / "jobs.sqlite3"
    assert store.is_file()
    job_id = small_job(server)
    assert finished(server, job_id)["status"] == "succeeded"
    assert jobs_row(servers, job_id)["status"] == "succeeded"  # the record there


def check_jobs_db(server, servers):
    """/readyz names the store's kind and sees the external cluster's worker (never its address); a
    job posted here is a row of that database (its tiles held: the row is read while it runs,
    before the TTL of 1 s could remove it), not of the jobs server's."""
    from app.jobs import db

    def cluster():  # from the store's last read, which this /readyz may have just started
        return requests.get(server.url + "/readyz", timeout=WAIT_S).json()["cluster"]
    wait_for(lambda: cluster() == {"store": "postgresql", "reachable": True, "workers": 1}, "/readyz: 1 worker")
    with HeldTiles(jobs_scheduler(servers), servers.tmp / f"held-{uuid.uuid4().hex}") as held:
        job_id = small_job(server)
        held.wait_started(job_id, timeout_s=WAIT_S)
        row = db.get_job(servers.store(), job_id)
        assert (row["status"], row["attempts"]) == ("running", 1), row
        assert row["owner"].split("-")[-2] == str(runner_pid(server))  # host-pid-token of this server's runner
        assert jobs_row(servers, job_id) is None
        assert requests.delete(f"{server.url}/v1/jobs/{job_id}", timeout=WAIT_S).status_code == 204
        assert db.get_job(servers.store(), job_id) is None


@contextlib.contextmanager
def deleted_on_failure(server, job_id: str):
    """A failing row's job deleted, so that BLOCKGRAD_MAX_JOBS = 1 does not fail the next row too."""
    try:
        yield
    except BaseException:
        requests.delete(f"{server.url}/v1/jobs/{job_id}", timeout=WAIT_S)
        raise


def check_lease(server, servers):
    """The server's runner SIGKILLed while its job's tile is held: the supervisor starts another,
    which takes the job over once the lease has passed (attempt 2, another owner). That the lease
    is the 2 s set, not the default 30 s, is read in the store: renewed at or before now, it
    never ends more than 2 s after now."""
    with HeldTiles(jobs_scheduler(servers), servers.tmp / f"held-{uuid.uuid4().hex}") as held:
        job_id = small_job(server)
        with deleted_on_failure(server, job_id):
            held.wait_started(job_id, timeout_s=WAIT_S)
            first = jobs_row(servers, job_id)
            assert (first["status"], first["attempts"]) == ("running", 1), first
            assert first["lease_until"] <= time.time() + 2, first
            killed = runner_pid(server)
            assert first["owner"].split("-")[-2] == str(killed)
            os.kill(killed, signal.SIGKILL)
            wait_for(lambda: job_state(server, job_id).json()["attempts"] == 2, "another runner took the job over")
            assert jobs_row(servers, job_id)["owner"].split("-")[-2] == str(runner_pid(server)) != str(killed)
            held.release()
            record = finished(server, job_id)
    assert (record["status"], record["attempts"]) == ("succeeded", 2), record
    answer = requests.get(f"{server.url}/v1/jobs/{job_id}/result", timeout=WAIT_S)
    assert answer.status_code == 200, answer.text
    truth = oracle(np.array(vectors(1, 1)), 1, "sum", 5.0)  # small_job's, the default offset 5
    assert_matches(answer.json()["losses"], expected(truth.losses, "float64"), "float64", what="losses")


def check_attempts(server, servers):
    """Each attempt's final task cancelled on the cluster (as a lost graph comes back to the
    runner): after the second, failed job_attempts_exhausted (the default, 3, would try again)."""
    from distributed import Future

    scheduler = jobs_scheduler(servers)
    dask = cluster_client(scheduler)
    with HeldTiles(scheduler, servers.tmp / f"held-{uuid.uuid4().hex}"):
        job_id = small_job(server)
        with deleted_on_failure(server, job_id):
            for attempt in (1, 2):
                key = f"blockgrad-finish-{job_id}-{attempt}"
                wait_for(lambda: dask.run_on_scheduler(has_task, key), f"the task {key}")
                dask.cancel([Future(key, dask)], force=True)
            record = finished(server, job_id)
    assert (record["status"], record["attempts"]) == ("failed", 2), record
    assert record["error"]["code"] == "job_attempts_exhausted"


def check_dask_workers(server, servers):
    assert finished(server, small_job(server))["status"] == "succeeded"  # time for every worker to join
    assert value(scrape(server), "blockgrad_cluster_workers") == 1


def check_max_job_n(server, servers):
    answer = submit_job(server, npy(np.ones((4097, 1))), "?factor=1", "application/x-npy")
    error = error_of(answer, 413, "limit_exceeded")
    assert error["details"] == {"limit": "BLOCKGRAD_MAX_JOB_N", "value": 4097, "allowed": 4096}


def check_max_job_body(server, servers):
    body = npy(np.ones((5000, 1)))
    assert len(body) > 40000
    error_of(submit_job(server, body, "?factor=1", "application/x-npy"), 413, "too_large")


def check_max_job_block(server, servers):
    answer = submit_job(server, {"vectors": vectors(128, 4), "factor": 1})
    error = error_of(answer, 413, "limit_exceeded")
    details = error["details"]
    assert (details["limit"], details["value"], details["allowed"]) == (
        "BLOCKGRAD_MAX_JOB_BLOCK_ELEMENTS", 128 * 128 * 8, 8192)
    assert details["suggested_factor"] == 4  # the smallest that fits: blocks of 32 x 32 x 8


HELD_TILE_BLOCKS = 4096  # a held job's 4 tiles of 64 x 64 blocks (factor 128)


def forget(server, job_id: str) -> None:
    """Cleanup: the job deleted (its runner drops it at its next renewal)."""
    assert requests.delete(f"{server.url}/v1/jobs/{job_id}", timeout=WAIT_S).status_code == 204


@contextlib.contextmanager
def held_job(server, servers):
    """(job id, HeldTiles): a job of 4 tiles (2048 x 8, factor 128: 16384 blocks) whose first
    tile is held at its start on the worker's one thread, so the job is running with no block
    done until a tile is released; deleted, then released, on leaving."""
    with HeldTiles(jobs_scheduler(servers), servers.tmp / f"held-{uuid.uuid4().hex}") as held:
        answer = submit_job(server, {"vectors": vectors(2048, 8), "factor": 128, "objective": "sum_of_squares",
                                     "outputs": ["losses"]})
        assert answer.status_code == 202, answer.text
        job_id = answer.json()["id"]
        try:
            held.wait_started(job_id, timeout_s=WAIT_S)
            yield job_id, held
        finally:
            forget(server, job_id)


def check_max_jobs(server, servers):
    with held_job(server, servers) as (job_id, _):
        assert job_state(server, job_id).json()["status"] == "running"
        error = error_of(submit_job(server, {"vectors": vectors(1, 1), "factor": 1}), 503, "overloaded")
        assert error["details"] == {"limit": "BLOCKGRAD_MAX_JOBS", "value": 1, "allowed": 1}


def held_result_bytes(servers) -> int:
    """What the results server's store holds or reserves for results: succeeded, queued and running jobs' bytes."""
    path = Path(servers.env_of("results")["BLOCKGRAD_DATA_DIR"]) / "jobs.sqlite3"
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return conn.execute("SELECT coalesce(sum(result_bytes), 0) FROM jobs "
                            "WHERE status IN ('queued', 'running', 'succeeded')").fetchone()[0]


def check_results_cap(server, servers):
    """A result over the cap is refused at admission (413); with the store filled by a victim's
    kept result, a cheap job waits (503 overloaded, Retry-After) and the victim's result is
    still served; once it is deleted the same POST is accepted. Nothing is ever evicted."""
    error = error_of(submit_job(server, {"vectors": vectors(501, 1), "factor": 1, "dtype": "float64",
                                         "outputs": ["accumulated"]}), 413, "limit_exceeded")
    assert error["details"] == {"limit": "BLOCKGRAD_MAX_JOB_RESULTS_BYTES", "value": 4008, "allowed": 4000}
    rows = (4000 - held_result_bytes(servers)) // 8  # the other rows' kept results hold the rest
    victim = small_job(server, n=rows, outputs=("accumulated",))
    try:
        assert finished(server, victim)["status"] == "succeeded"
        refused = submit_job(server, {"vectors": vectors(1, 1), "factor": 1, "dtype": "float64",
                                      "outputs": ["losses"]})  # 8 bytes: one more than the store takes
        error = error_of(refused, 503, "overloaded")
        assert error["details"]["limit"] == "BLOCKGRAD_MAX_JOB_RESULTS_BYTES" and refused.headers["Retry-After"]
        kept = requests.get(f"{server.url}/v1/jobs/{victim}/result", timeout=WAIT_S)
        assert kept.status_code == 200 and len(kept.json()["accumulated"]) == rows
    finally:
        forget(server, victim)
    forget(server, small_job(server))  # room again


def check_max_job_result(server, servers):
    """A job's result over it is refused before it is stored; one within it is accepted."""
    body = {"vectors": vectors(182, 1), "factor": 182, "objective": "sum", "dtype": "float64", "outputs": ["losses"]}
    error = error_of(submit_job(server, body), 413, "limit_exceeded")  # 182 x 182 float64 losses
    assert error["details"] == {"limit": "BLOCKGRAD_MAX_JOB_RESULT_BYTES", "value": 264992, "allowed": 262144}
    within = submit_job(server, {**body, "vectors": vectors(181, 1), "factor": 181})
    assert within.status_code == 202, within.text
    forget(server, within.json()["id"])


def check_job_records(server, servers):
    """With BLOCKGRAD_MAX_JOB_RECORDS finished jobs kept and none expired, a POST waits (503
    overloaded) and every kept job still answers; with one fewer, it is accepted. The filler
    records are written into the store as the runner leaves failed jobs."""
    path = Path(servers.env_of("results")["BLOCKGRAD_DATA_DIR"]) / "jobs.sqlite3"
    with contextlib.closing(sqlite3.connect(path, timeout=WAIT_S)) as conn, conn:
        kept = conn.execute("SELECT count(*) FROM jobs WHERE status IN ('succeeded', 'failed', 'cancelled')"
                            ).fetchone()[0]
        now = time.time()
        fillers = [(uuid.uuid4().hex, now) for _ in range(1000 - kept)]
        conn.executemany("INSERT INTO jobs (id, status, n, dim, factor, objective, \"offset\", dtype, outputs, "
                         "blocks_total, result_bytes, blocks_done, created_at, finished_at, attempts) VALUES "
                         "(?, 'failed', 1, 1, 1, 'sum', 0, 'float64', 'losses', 1, 8, 0, ?, ?, 1)",
                         [(job_id, at, at) for job_id, at in fillers])
    try:
        error = error_of(submit_job(server, {"vectors": vectors(1, 1), "factor": 1}), 503, "overloaded")
        assert error["details"] == {"limit": "BLOCKGRAD_MAX_JOB_RECORDS", "value": 1000, "allowed": 1000}
        assert job_state(server, fillers[0][0]).json()["status"] == "failed"
    finally:
        with contextlib.closing(sqlite3.connect(path, timeout=WAIT_S)) as conn, conn:
            conn.execute("DELETE FROM jobs WHERE id = ?", (fillers[0][0],))
    forget(server, small_job(server))
    with contextlib.closing(sqlite3.connect(path, timeout=WAIT_S)) as conn, conn:
        conn.executemany("DELETE FROM jobs WHERE id = ?", [(job_id,) for job_id, _ in fillers])


def check_job_ttl(server, servers):
    """A finished job is 404 once its TTL has passed (its end seen in the runner's log line, as
    a poll could miss the 1 s), then the runner's sweep deletes its rows from the store."""
    from app.jobs import db

    job_id = small_job(server)
    wait_for(lambda: job_state(server, job_id).status_code == 404, "the finished job forgotten after 1 s")
    error_of(job_state(server, job_id), 404, "job_not_found")
    assert runner_line(server, job_id)["status"] == "succeeded"
    wait_for(lambda: db.get_job(servers.store(), job_id) is None, "its row deleted by the sweep")
    with servers.store().connect() as conn:
        assert conn.execute(db.select(db.func.count()).where(db.results.c.job_id == job_id)).scalar() == 0


def check_external_scheduler(server, servers):
    """Its supervisor runs the runner alone, on the jobs server's cluster, which computes its jobs."""
    from app.jobs import db

    assert supervised(server) == ["runner"], "it started a cluster"
    line = runner_line(server, small_job(server))
    assert (line["status"], line["stored"]) == ("succeeded", True)
    with servers.store().connect() as conn:
        schedulers = set(conn.execute(db.select(db.runners.c.scheduler)).scalars())
    assert schedulers == {jobs_scheduler(servers)}


def check_no_cluster(server, servers):
    error_of(requests.get(f"{server.url}/v1/jobs/{'0' * 32}", headers=AUTH, timeout=WAIT_S), 503,
             "cluster_unavailable")


def check_auth(server, servers):
    """The row's server binds loopback: no token needed. One beyond it without a token never
    starts (it would have to come up first: no worker boots)."""
    env = {**os.environ, "BLOCKGRAD_BIND": "0.0.0.0:0", "BLOCKGRAD_DASK_SCHEDULER": "off"}
    env.pop("BLOCKGRAD_API_TOKEN", None)
    env.pop("BLOCKGRAD_AUTH", None)
    done = subprocess.run(gunicorn_command(), cwd=ROOT, env=env, capture_output=True, text=True, timeout=WAIT_S)
    assert done.returncode != 0 and "without BLOCKGRAD_API_TOKEN" in done.stdout + done.stderr
    assert requests.get(f"{server.url}/healthz", timeout=WAIT_S).status_code == 200


# Traces' collectors, one per protocol, up before any server exports to them.


def traced_request(server, headers: dict | None = None) -> tuple[str, str]:
    """A /v1 request with a traceparent: (its trace id, the caller's span id)."""
    trace_id, parent_id = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    answer = post(server, "/v1/gradients", gradients(2, 1, 1), {"traceparent": f"00-{trace_id}-{parent_id}-01",
                                                               **(headers or {})})
    assert answer.status_code == 200, answer.text
    return trace_id, parent_id


def check_otlp_endpoint(server, servers):
    trace_id, parent_id = traced_request(server, AUTH)
    received = servers.otlp("http").wait_for(trace_id, {"POST /v1/gradients", "compute"}, WAIT_S)
    assert [got.span.parent_span_id.hex() for got in received if got.name == "POST /v1/gradients"] == [parent_id]


def check_service_name(server, servers):
    trace_id, _ = traced_request(server, AUTH)
    received = servers.otlp("http").wait_for(trace_id, {"render"}, WAIT_S)
    assert {got.resource["service.name"] for got in received} == {"blockgrad-promises"}


def check_otlp_grpc(server, servers):
    """The traces endpoint alone, over gRPC: its collector gets them, the HTTP one nothing."""
    trace_id, _ = traced_request(server)
    assert servers.otlp("grpc").wait_for(trace_id, {"POST /v1/gradients", "render"}, WAIT_S)
    assert servers.otlp("http").of_trace(trace_id) == []


VARIABLES = [
    Var("BLOCKGRAD_BIND", "(127.0.0.1:<free port>, set by tools/server.py)", "limits",
        "the server listens and answers there", check_bind),
    Var("BLOCKGRAD_GRPC_BIND", "(127.0.0.1:<free port>, set by tools/server.py)", "limits",
        "gRPC listens there: ServerLive, grpc.health.v1 SERVING", check_grpc_bind),
    Var("BLOCKGRAD_GRPC_MAX_MESSAGE_BYTES", "100000", "timeouts", "a 204,800-byte answer refused before "
        "computing, a 128,000-byte request RESOURCE_EXHAUSTED", check_grpc_message_limit),
    Var("WEB_CONCURRENCY", "3", "timeouts", "three gunicorn workers", check_workers),
    Var("BLOCKGRAD_DEVICE", "cuda:9", "cost", "/readyz 503 not_ready (no such device)", check_device),
    Var("BLOCKGRAD_MAX_BODY_BYTES", "4096", "limits", "4097 bytes: 413 too_large, 4096: 200", check_max_body),
    Var("BLOCKGRAD_MAX_N", "5", "limits", "6 vectors: 413 naming it, 5: 200", check_max_n),
    Var("BLOCKGRAD_MAX_D", "3", "limits", "D=4: 413 naming it", check_max_d),
    Var("BLOCKGRAD_MAX_OUTPUT_ELEMENTS", "100", "limits", "135 numbers: 413 naming it", check_max_output),
    Var("BLOCKGRAD_MAX_BLOCK_ELEMENTS", "32", "limits", "a 64-number block: 413 with a factor", check_max_block),
    Var("BLOCKGRAD_MAX_ACTIVATION_BYTES", "300", "limits", "a model's 4 pairs: 413 naming it, 1 pair: 200",
        check_max_activation),
    Var("BLOCKGRAD_REQUEST_TIMEOUT_S", "7", "cost", "predicted 17.08 s: 413 with deadline_s 7", check_request_timeout),
    Var("BLOCKGRAD_WORKER_MEMORY_BYTES", "33554432", "cost", "any computation: 413 naming it", check_worker_memory),
    Var("BLOCKGRAD_UPLOAD_MEMORY_SHARE", "0.002", "cost", "a 200 KiB body refused while it arrives",
        check_upload_share),
    Var("BLOCKGRAD_QUEUE_DEPTH", "1", "metrics", "slot held, one queued: the next is 503 overloaded",
        check_queue_depth),
    Var("BLOCKGRAD_SLOTS_PER_REQUEST", "1", "timeouts", "one request holds one slot of two", check_slots_per_request),
    Var("BLOCKGRAD_KEEPALIVE_S", "1", "timeouts", "an idle kept-alive connection is closed", check_keepalive),
    Var("BLOCKGRAD_READ_TIMEOUT_S", "2", "timeouts", "a stalled body: 408 naming 2 s", check_read_timeout),
    Var("BLOCKGRAD_HEADER_TIMEOUT_S", "1", "timeouts", "a partial head: 408 with timeout_s 1", check_header_timeout),
    Var("BLOCKGRAD_MAX_CONNECTIONS", "3", "limits", "a start-up warning; the oldest silent connection evicted",
        check_max_connections),
    Var("BLOCKGRAD_SEND_TIMEOUT_S", "1", "timeouts", "an unread answer: logged send_timeout", check_send_timeout),
    Var("BLOCKGRAD_COST_PER_BLOCK_S", "1", "cost", "predicted_s = 64 blocks x 1 s + ...", check_cost_per_block),
    Var("BLOCKGRAD_COST_PER_NUMBER_S", "1e-4", "cost", "predicted_s = 1 + 160800 x 1e-4", check_cost_per_number),
    Var("BLOCKGRAD_API_TOKEN", TOKEN, "limits", "401 without the token, probes open", check_token),
    Var("BLOCKGRAD_AUTH", "(on, the default)", "cost", "a bind beyond loopback without a token: no start",
        check_auth),
    Var("BLOCKGRAD_DOCS_PUBLIC", "false", "limits", "/docs and /openapi.json need the token", check_docs_private),
    Var("BLOCKGRAD_MODEL_DIR", "{tmp}/models", "limits", "its model is an objective", check_model_dir),
    Var("BLOCKGRAD_DASK_SCHEDULER", "", "jobs", "blank: an embedded cluster runs jobs", check_embedded_cluster),
    Var("BLOCKGRAD_DASK_SCHEDULER", "(the jobs server's scheduler)", "ttl", "connects to it, starts nothing",
        check_external_scheduler),
    Var("BLOCKGRAD_DASK_SCHEDULER", "off", "limits", "job routes: 503 cluster_unavailable", check_no_cluster),
    Var("BLOCKGRAD_DASK_WORKERS", "1", "jobs", "blockgrad_cluster_workers 1", check_dask_workers),
    Var("BLOCKGRAD_MAX_JOB_N", "4096", "jobs", "4097 vectors: 413 naming it", check_max_job_n),
    Var("BLOCKGRAD_MAX_JOB_BODY_BYTES", "40000", "jobs", "a 40128-byte .npy: 413 too_large", check_max_job_body),
    Var("BLOCKGRAD_MAX_JOB_BLOCK_ELEMENTS", "8192", "jobs", "413 with the smallest factor that fits",
        check_max_job_block),
    Var("BLOCKGRAD_MAX_JOBS", "1", "jobs", "one job running: the next POST is 503 overloaded", check_max_jobs),
    Var("BLOCKGRAD_JOB_TTL_S", "1", "ttl", "a finished job is 404 after it", check_job_ttl),
    Var("BLOCKGRAD_MAX_JOB_RESULTS_BYTES", "4000", "results", "a 4008-byte result: 413; the store full: 503 and "
        "the kept result served", check_results_cap),
    Var("BLOCKGRAD_MAX_JOB_RESULT_BYTES", "262144", "ttl", "a 264992-byte result: 413 naming it",
        check_max_job_result),
    Var("BLOCKGRAD_MAX_JOB_RECORDS", "1000", "results", "1000 finished jobs kept: 503 overloaded", check_job_records),
    Var("BLOCKGRAD_DATA_DIR", "{tmp}/jobs-data", "jobs", "the store jobs.sqlite3 there holds its jobs",
        check_data_dir),
    Var("BLOCKGRAD_JOBS_DB", "(a PostgreSQL database of this module)", "ttl", "/readyz store postgresql; "
        "its jobs are rows there", check_jobs_db),
    Var("BLOCKGRAD_JOB_LEASE_S", "2", "jobs", "its runner SIGKILLed mid-job: the next takes the job over, "
        "attempt 2 succeeds", check_lease),
    Var("BLOCKGRAD_JOB_ATTEMPTS", "2", "jobs", "a graph lost twice: failed job_attempts_exhausted",
        check_attempts),
    Var("BLOCKGRAD_LOG_LEVEL", "WARNING", "limits", "no per-request log line", check_log_warning),
    Var("BLOCKGRAD_LOG_LEVEL", "(INFO, the default)", "timeouts", "one log line per request", check_log_info),
    Var("PROMETHEUS_MULTIPROC_DIR", "{tmp}/metrics", "limits", "emptied at start, then holds the values",
        check_metrics_dir),
    Var("OTEL_EXPORTER_OTLP_ENDPOINT", "{otlp[http]}", "limits", "a /v1 request's spans reach this "
        "collector, the caller's span their parent", check_otlp_endpoint),
    Var("OTEL_SERVICE_NAME", "blockgrad-promises", "limits", "the spans' service.name", check_service_name),
    Var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "{otlp[grpc]}", "timeouts", "the spans reach this "
        "(gRPC) collector", check_otlp_grpc),
    Var("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc", "timeouts", "spans sent over gRPC", check_otlp_grpc),
]


@pytest.mark.parametrize("row", VARIABLES, ids=lambda row: f"{row.variable}={row.value}@{row.group}")
def test_documented_variable_has_its_effect(row, servers):
    row.check(servers[row.group], servers)


def documented_variables() -> set[str]:
    """The first column of docs/configuration.md's "Environment variables" table."""
    text = (DOCS / "configuration.md").read_text()
    table = text.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    names = set()
    for line in table.splitlines():
        if line.startswith("| `"):
            names.update(re.findall(r"`([A-Z][A-Z0-9_]+)`", line.split("|")[1]))
    return names


def test_every_documented_variable_has_a_row():
    documented = documented_variables()
    assert len(documented) >= 34, documented  # the parse found the table
    assert documented - {row.variable for row in VARIABLES} == set()


@pytest.mark.parametrize("variable,bad", [
    ("BLOCKGRAD_MAX_N", "0"), ("BLOCKGRAD_HEADER_TIMEOUT_S", "-1"), ("BLOCKGRAD_DOCS_PUBLIC", "maybe"),
    ("BLOCKGRAD_DASK_SCHEDULER", "http://scheduler:8786"), ("WEB_CONCURRENCY", "two"), ("BLOCKGRAD_AUTH", "maybe"),
    ("BLOCKGRAD_JOBS_DB", "mysql://db/blockgrad"),
])
def test_a_bad_value_stops_the_start_naming_the_variable(variable, bad):
    env = {**os.environ, "BLOCKGRAD_BIND": "127.0.0.1:1", "BLOCKGRAD_DASK_SCHEDULER": "off", variable: bad}
    done = subprocess.run(gunicorn_command(), cwd=ROOT, env=env, capture_output=True, text=True, timeout=WAIT_S)
    assert done.returncode != 0
    assert variable in done.stdout + done.stderr


def test_an_external_scheduler_without_a_database_stops_the_start_naming_both():
    """docs/configuration.md: an external BLOCKGRAD_DASK_SCHEDULER needs BLOCKGRAD_JOBS_DB."""
    env = {**os.environ, "BLOCKGRAD_BIND": "127.0.0.1:1", "BLOCKGRAD_DASK_SCHEDULER": "tcp://127.0.0.1:8786"}
    env.pop("BLOCKGRAD_JOBS_DB", None)
    done = subprocess.run(gunicorn_command(), cwd=ROOT, env=env, capture_output=True, text=True, timeout=WAIT_S)
    assert done.returncode != 0
    assert "BLOCKGRAD_DASK_SCHEDULER" in done.stdout + done.stderr and "BLOCKGRAD_JOBS_DB" in done.stdout + done.stderr


# --- the metrics /metrics exposes (docs/operations.md, connections.md, jobs.md)

GOOD = {"vectors": [[0.5, 1.0, 1.5], [2.0, 2.5, 3.0], [3.5, 4.0, 4.5], [5.0, 5.5, 6.0]], "factor": 2,
        "outputs": ["blocks", "accumulated", "losses"]}
GOOD_NUMBERS = 112  # blocks 4*4*2*3 + accumulated 4*3 + losses 2*2


def around(server, event: Callable[[], None]) -> tuple[dict, dict]:
    before = scrape(server)
    event()
    return before, scrape(server)


def delta(before, after, name: str, **labels) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def good_request(server) -> None:
    answer = post(server, "/v1/gradients", GOOD)
    assert answer.status_code == 200 and len(answer.json()["blocks"]) == 4


def held_observation(server, servers) -> dict:
    """Once per module: scrapes at rest, with the slot held and one queued, and after."""
    if "held" not in servers.observed:
        # At rest and after: waited for, not sampled. A request leaves the gauge a moment after
        # it frees its slot and its place in line (its error answer is made in between).
        rest = wait_for_metric(server, "blockgrad_requests_in_flight", 1)
        for held, third in hold_slot_and_queue(server):
            error_of(third, 503, "overloaded")
            refused = scrape(server)
        after = wait_for_metric(server, "blockgrad_requests_in_flight", 1)
        servers.observed["held"] = {"rest": rest, "held": held, "refused": refused, "after": after}
    return servers.observed["held"]


def quiet(server) -> dict:
    """A scrape once no connection but the scrape's own is open (others' closes counted)."""
    def alone():
        samples = scrape(server)
        return (value(samples, "blockgrad_connections_open"), value(samples, "blockgrad_connections_idle"),
                value(samples, "blockgrad_connections_awaiting_head")) == (1, 0, 0)
    wait_for(alone, "only the scrape's connection open")
    return scrape(server)


def m_requests(server, servers):
    before, after = around(server, lambda: good_request(server))
    assert delta(before, after, "blockgrad_requests_total", route="/v1/gradients", method="POST", status=200) == 1


def m_duration(server, servers):
    before, after = around(server, lambda: good_request(server))
    name, route = "blockgrad_request_duration_seconds", "/v1/gradients"
    assert delta(before, after, f"{name}_count", route=route) == 1
    assert delta(before, after, f"{name}_bucket", route=route, le="+Inf") == 1
    assert delta(before, after, f"{name}_sum", route=route) > 0


def m_in_flight(server, servers):
    seen = held_observation(server, servers)
    assert value(seen["rest"], "blockgrad_requests_in_flight") == 1  # the scrape itself
    assert value(seen["held"], "blockgrad_requests_in_flight") == 3  # computing, queued, the scrape
    assert value(seen["after"], "blockgrad_requests_in_flight") == 1


def m_output_numbers(server, servers):
    before, after = around(server, lambda: good_request(server))
    assert delta(before, after, "blockgrad_output_numbers_total") == GOOD_NUMBERS


def m_compute_seconds(server, servers):
    before, after = around(server, lambda: good_request(server))
    assert delta(before, after, "blockgrad_compute_seconds_total") > 0  # a duration: no literal
    before, after = around(server, lambda: error_of(post(server, "/v1/gradients", {"vectors": [[1.0]], "factor": 2}),
                                                    422, "validation_error"))
    assert delta(before, after, "blockgrad_compute_seconds_total") == 0  # refused before computing


def m_errors(server, servers):
    before, after = around(server, lambda: error_of(post(server, "/v1/gradients", {"vectors": [[1.0]], "factor": 2}),
                                                    422, "validation_error"))
    assert delta(before, after, "blockgrad_errors_total", code="validation_error") == 1
    assert summed(after, "blockgrad_errors_total") - summed(before, "blockgrad_errors_total") == 1


def m_device(server, servers):
    assert requests.get(server.url + "/readyz", timeout=WAIT_S).json()["device"] == "cpu"
    assert summed(scrape(server), "blockgrad_device_info", device="cpu") == 1  # one worker, one sample


def m_queue_depth(server, servers):
    seen = held_observation(server, servers)
    assert [value(seen[k], "blockgrad_queue_depth") for k in ("rest", "held", "after")] == [0, 1, 0]


def m_queue_wait(server, servers):
    before, after = around(server, lambda: good_request(server))
    assert delta(before, after, "blockgrad_queue_wait_seconds_count") == 1
    assert delta(before, after, "blockgrad_queue_wait_seconds_bucket", le="+Inf") == 1


def m_shed(server, servers):
    seen = held_observation(server, servers)
    assert delta(seen["rest"], seen["refused"], "blockgrad_shed_requests_total") == 1


def m_slots(server, servers):
    assert value(scrape(server), "blockgrad_compute_slots") == 1  # the server may use one CPU


def m_slots_busy(server, servers):
    seen = held_observation(server, servers)
    assert [value(seen[k], "blockgrad_compute_slots_busy") for k in ("rest", "held", "after")] == [0, 1, 0]


def m_trace_spans_dropped(server, servers):
    assert value(scrape(server), "blockgrad_trace_spans_dropped_total") == 0  # tracing off; a full queue's drops: test_tracing_dead.py


def kept_alive(server) -> socket.socket:
    sock = connect(server)
    sock.sendall(head("GET", "/healthz"))
    assert read_answer(sock)[0] == 200
    return sock


def m_open(server, servers):
    quiet(server)
    with kept_alive(server):
        samples = wait_for_metric(server, "blockgrad_connections_idle", 1)
        assert value(samples, "blockgrad_connections_open") == 2  # it and the scrape
    wait_for_metric(server, "blockgrad_connections_open", 1)


def m_idle(server, servers):
    quiet(server)
    with kept_alive(server):
        samples = wait_for_metric(server, "blockgrad_connections_idle", 1)
        assert value(samples, "blockgrad_connections_awaiting_head") == 0
    wait_for_metric(server, "blockgrad_connections_idle", 0)


def m_awaiting_head(server, servers):
    quiet(server)
    with connect(server) as silent, connect(server) as partial:
        partial.sendall(b"GET /healthz HTTP/1.1\r\nHost:")
        samples = wait_for_metric(server, "blockgrad_connections_awaiting_head", 2)  # new ones included
        assert value(samples, "blockgrad_connections_idle") == 0
        del silent
    wait_for_metric(server, "blockgrad_connections_awaiting_head", 0)


def m_closed(server, servers):
    before = quiet(server)
    with connect(server):
        wait_for_metric(server, "blockgrad_connections_awaiting_head", 1)
    reason = "client_closed"  # the client closed it while it waited in the poller
    expected = value(before, "blockgrad_connections_closed_total", reason=reason) + 1
    wait_for(lambda: value(scrape(server), "blockgrad_connections_closed_total", reason=reason) >= expected,
             "the close counted")
    after = quiet(server)
    assert value(after, "blockgrad_connections_closed_total", reason=reason) == expected
    assert delta(before, after, "blockgrad_connections_closed_total", reason="evicted") == 0


def m_jobs(server, servers):
    with held_job(server, servers):
        held = scrape(server)
    assert (value(held, "blockgrad_jobs", status="queued"), value(held, "blockgrad_jobs", status="running")) == (0, 1)
    before = scrape(server)
    job_id = small_job(server)
    assert finished(server, job_id)["status"] == "succeeded"
    after = scrape(server)
    assert delta(before, after, "blockgrad_jobs", status="succeeded") == 1
    assert (value(after, "blockgrad_jobs", status="queued"), value(after, "blockgrad_jobs", status="running")) == (0, 0)


def m_job_blocks_done(server, servers):
    assert value(scrape(server), "blockgrad_job_blocks_done") == 0  # no job queued or running
    with held_job(server, servers) as (job_id, held):
        assert value(scrape(server), "blockgrad_job_blocks_done") == 0  # running, its first tile held
        [(_, first)] = held.started(job_id)
        held.release_tile(first)
        held.wait_started(job_id, 2, WAIT_S)  # the first tile returned; the second is held
        seen = {}

        def moved():
            seen["done"] = value(scrape(server), "blockgrad_job_blocks_done")
            return seen["done"] != 0
        wait_for(moved, "the released tile counted")  # the runner writes it at its next renewal
        assert seen["done"] == HELD_TILE_BLOCKS  # exactly one tile done, the job still running
        assert job_state(server, job_id).json()["progress"] == {"blocks_done": HELD_TILE_BLOCKS, "blocks_total": 16384}
    assert value(scrape(server), "blockgrad_job_blocks_done") == 0


def m_cluster_workers(server, servers):
    assert finished(server, small_job(server))["status"] == "succeeded"  # a worker is surely there
    assert value(scrape(server), "blockgrad_cluster_workers") == 1


def m_job_events(server, servers):
    before = scrape(server)
    finished(server, small_job(server))
    after = scrape(server)
    assert delta(before, after, "blockgrad_job_events_total", event="submitted") == 1


@dataclass(frozen=True)
class Metric:
    family: str  # as the text format's parser names it (counters without _total)
    group: str
    event: str
    check: Callable


METRICS = [
    Metric("blockgrad_requests", "metrics", "a 200 on /v1/gradients: +1 for its route, method, status", m_requests),
    Metric("blockgrad_request_duration_seconds", "metrics", "a 200: count and +Inf bucket +1", m_duration),
    Metric("blockgrad_requests_in_flight", "metrics", "1 at rest, 3 with one computing and one queued", m_in_flight),
    Metric("blockgrad_output_numbers", "metrics", "a 200 of 112 numbers: +112", m_output_numbers),
    Metric("blockgrad_compute_seconds", "metrics", "a 200: grows; a 422: +0", m_compute_seconds),
    Metric("blockgrad_errors", "metrics", "a 422 validation_error: +1 for its code", m_errors),
    Metric("blockgrad_device_info", "metrics", "/readyz: device=cpu 1", m_device),
    Metric("blockgrad_queue_depth", "metrics", "0, 1 with one queued, 0", m_queue_depth),
    Metric("blockgrad_queue_wait_seconds", "metrics", "a computed request: count +1", m_queue_wait),
    Metric("blockgrad_shed_requests", "metrics", "the queue full: +1", m_shed),
    Metric("blockgrad_compute_slots", "metrics", "1 on one CPU", m_slots),
    Metric("blockgrad_compute_slots_busy", "metrics", "0, 1 while a request computes, 0", m_slots_busy),
    Metric("blockgrad_trace_spans_dropped", "metrics", "0 with tracing off (a full queue's drops: test_tracing_dead)",
           m_trace_spans_dropped),
    Metric("blockgrad_connections_open", "metrics", "2 with a kept-alive one, back to 1", m_open),
    Metric("blockgrad_connections_idle", "metrics", "1 kept alive after its answer, 0 once closed", m_idle),
    Metric("blockgrad_connections_awaiting_head", "metrics", "2: a silent and a partial head, then 0",
           m_awaiting_head),
    Metric("blockgrad_connections_closed", "metrics", "a client closing a silent one: client_closed +1", m_closed),
    Metric("blockgrad_jobs", "jobs", "running 1 while its tiles are held; a job succeeded: succeeded +1, none "
           "queued or running", m_jobs),
    Metric("blockgrad_job_blocks_done", "jobs", "0 while a job's tiles are held, 4096 with one tile released, "
           "0 once deleted", m_job_blocks_done),
    Metric("blockgrad_cluster_workers", "jobs", "1 with BLOCKGRAD_DASK_WORKERS=1", m_cluster_workers),
    Metric("blockgrad_job_events", "jobs", "a 202: submitted +1", m_job_events),
]


@pytest.mark.parametrize("row", METRICS, ids=lambda row: row.family)
def test_metric_moves_with_its_event(row, servers):
    row.check(servers[row.group], servers)


def test_every_exposed_metric_has_a_row(servers):
    """The metrics server after a request of each kind (a labelled family shows once used),
    and the jobs server after a job."""
    metrics, jobs = servers["metrics"], servers["jobs"]
    good_request(metrics)
    error_of(post(metrics, "/v1/gradients", {"vectors": [[1.0]], "factor": 2}), 422, "validation_error")
    requests.get(metrics.url + "/readyz", timeout=WAIT_S)
    finished(jobs, small_job(jobs))
    exposed = families(metrics) | families(jobs)
    assert len(exposed) >= 20, exposed
    assert exposed - {row.family for row in METRICS} == set()


# --- documented claims no other test saw on the real server (issue 27, point 7)


def test_a_json_suffix_media_type_is_json(servers):
    """docs/api.md: `application/json` or another `application/*+json`."""
    server = servers["timeouts"]
    plain = post(server, "/v1/gradients", GOOD)
    suffixed = post(server, "/v1/gradients", GOOD, {"Content-Type": "application/vnd.example+json; charset=utf-8"})
    assert plain.status_code == suffixed.status_code == 200
    assert suffixed.json() == plain.json()
    error_of(post(server, "/v1/gradients", GOOD, {"Content-Type": "text/plain"}), 415, "unsupported_media_type")


@pytest.mark.parametrize("length,status", [(4094, 404), (4095, 414)])
def test_a_request_line_over_4094_bytes_is_gunicorns_414(servers, length, status):
    """docs/api.md and errors-edge.md: 414 for a request line over 4094 bytes, by gunicorn."""
    server = servers["timeouts"]
    path = "/" + "a" * (length - len("GET / HTTP/1.1"))
    line = f"GET {path} HTTP/1.1".encode()
    assert len(line) == length
    with connect(server) as sock:
        sock.sendall(line + b"\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        answer = read_to_eof(sock)
    assert answer.startswith(f"HTTP/1.1 {status} ".encode()), answer[:200]
    if status == 404:
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "not_found"


ERROR_BODY_BOUND = 16384  # docs/api.md: "Every error body is at most 16 KiB whatever the request"


@pytest.mark.parametrize("body", [
    {"vectors": [[1.0]], **{f"unknown_{i}": i for i in range(100_000)}},  # many unknown fields
    {"vectors": [[1.0]], "x" * 1_000_000: 1},  # one field with a long name
    {"vectors": [[1.0]], "objective": "y" * 1_000_000},  # a long value quoted back
], ids=["many-fields", "long-name", "long-value"])
def test_an_error_body_is_at_most_16_kib(servers, body):
    answer = post(servers["timeouts"], "/v1/gradients", body)
    error_of(answer, 422, "validation_error")
    assert len(answer.content) <= ERROR_BODY_BOUND


def test_every_metric_row_is_documented():
    """Each family in the table is named in docs/ (a counter as its _total sample)."""
    text = "".join(path.read_text() for path in DOCS.glob("*.md"))
    named = set(re.findall(r"`(blockgrad_[a-z_]+)", text))
    missing = [row.family for row in METRICS if row.family not in named and f"{row.family}_total" not in named]
    assert missing == []
