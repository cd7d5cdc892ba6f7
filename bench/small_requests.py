"""Issue 18's small-requests row: the README's 10 x 5 example, this service against a minimal
Flask app doing the same computation (bench/peer.py, gunicorn sync workers), side by side.

Same conditions for both: 2 workers, the same body and default outputs (blocks and accumulated,
1050 numbers), the same load driver (rows.load: each client thread its own requests.Session,
a warm-up, then back to back for a phase). The two servers run at once and are measured in
alternating rounds, so both see the same load on a shared machine; the ratio is the median
over rounds. Beside the rate, each app's server CPU time per request, read from /proc: the
machine's noise moves it much less than the rate.

In the same run, the ratio taken apart (info rows, `taken_apart`): the service's app under
gunicorn's sync worker (the peer's worker class, one thread, no gRPC; the service's
gunicorn.conf.py otherwise) against the peer, the apps alone as served; and the service against
the same app and settings under gunicorn's stock gthread worker, what ConnectionWorker adds.
Then the same comparison as the row's with the no-op WSGI app (bench/noop.py) under each app's
server (the service's gunicorn.conf.py, the peer's sync settings): what the servers alone
cost, the part of the ratio no change to the app can move (docs/small-requests.md). And what
the threaded server buys, on the same two servers: the seed request sent behind one silent
connection per worker (connected, nothing sent yet: a slow client, a balancer's spare).
"""
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import requests

from tools.server import ROOT, Server, children, cpu_ticks, free_port, gunicorn_server, stop

from . import workloads
from .measure import Result, at_least
from .rows import load

WORKERS = 2
CLIENTS = (1, 4)
ROUNDS = 5  # alternating rounds per client count (service, peer, service, peer, ...)
PHASE_S = 3.0  # seconds of one app's load in one round, after its warm-up
TARGET = 0.95  # issue 28: at least 0.95x of the peer, by cutting work from the app's path, never by scheduling threads
LOAD_WARM_UP = 5  # requests rows.load sends per client before it starts counting
SILENT_WAIT_S = 5.0  # how long the request behind the silent connections is given
PEER_APP = "bench.peer:app"
NOOP_APP = "bench.noop:app"
PEER_CONFIG = "bench/peer_gunicorn.py"
BODY = workloads.body(workloads.SEED_EXAMPLE, factor=2)
# --threads 1: with threads > 1 gunicorn runs gthread whatever --worker-class says.
APP_ON_SYNC_ENV = {"GUNICORN_CMD_ARGS": "--worker-class sync --threads 1", "BLOCKGRAD_GRPC_BIND": "off"}
STOCK_GTHREAD_ENV = {"GUNICORN_CMD_ARGS": "--worker-class gthread"}
TICKS_PER_S = os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def peer_server(workers: int = WORKERS, torch_threads: int = 1, app: str = PEER_APP):
    """The peer (or `app`) under gunicorn's sync worker on 127.0.0.1:<free port>; the whole process group
    is killed in `finally` (tools.server.stop)."""
    port = free_port()
    script = Path(sys.executable).parent / "gunicorn"
    launcher = [str(script)] if script.exists() else [sys.executable, "-m", "gunicorn"]
    command = [*launcher, "-c", PEER_CONFIG, "--bind", f"127.0.0.1:{port}", app]
    env = {**os.environ, "PEER_WORKERS": str(workers), "PEER_TORCH_THREADS": str(torch_threads)}
    env.pop("GUNICORN_CMD_ARGS", None)  # the peer's settings are its own file's
    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(tmp) / "peer.log"
        with open(log_path, "wb") as log_file:
            process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        try:
            server = Server(process, port, workers, log_path)
            server.wait_ready("/healthz")
            yield server
        finally:
            stop(process)


def workers_cpu_s(server: Server) -> float:
    """CPU seconds (user + system) of all the server's workers so far: the live ones from their
    /proc/<pid>/stat, the exited ones (a recycled worker) from the master's cutime + cstime."""
    fields = Path(f"/proc/{server.pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[13]) + int(fields[14])  # cutime, cstime: fields 16 and 17
    for pid in children(server.pid):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            ticks += cpu_ticks(pid)
    return ticks / TICKS_PER_S


@dataclass(frozen=True)
class Phase:
    rate: float  # requests per second the clients saw
    cpu_ms: float  # the workers' CPU milliseconds per request served
    client_cpu_ms: float  # this process's (the load driver's) CPU milliseconds per request


def phase(server: Server, clients: int, seconds: float, path: str = "/v1/gradients") -> Phase:
    before, client_before = workers_cpu_s(server), time.process_time()
    rate, latencies, _ = load(server, path, BODY, clients=clients, seconds=seconds)
    served = len(latencies) + LOAD_WARM_UP * clients
    return Phase(rate, 1e3 * (workers_cpu_s(server) - before) / served,
                 1e3 * (time.process_time() - client_before) / served)


def answer_arrays(server: Server) -> tuple[np.ndarray, np.ndarray]:
    """(block gradients, accumulated) of the server's answer to BODY, as float32 arrays."""
    response = requests.post(server.url + "/v1/gradients", data=BODY, timeout=60,
                             headers={"Content-Type": "application/json"})
    response.raise_for_status()
    answer = response.json()
    blocks = np.array([block["gradient"] for block in answer["blocks"]], dtype=np.float32)
    return blocks, np.array(answer["accumulated"], dtype=np.float32)


def same_answer(service: Server, peer: Server) -> None:
    mine, theirs = answer_arrays(service), answer_arrays(peer)
    if not all(a.shape == b.shape and np.array_equal(a, b) for a, b in zip(mine, theirs, strict=True)):
        raise RuntimeError("the service and the peer disagree on the 10x5 example")
    if sum(a.size for a in mine) != 1050:
        raise RuntimeError(f"expected 1050 numbers, got {sum(a.size for a in mine)}")


def medians(pairs: list[tuple[Phase, Phase]], field: str) -> tuple[float, float]:
    """The median of one Phase field over the rounds: (first server, second)."""
    first, second = zip(*pairs)
    return statistics.median(getattr(p, field) for p in first), statistics.median(getattr(p, field) for p in second)


def median_ratio(pairs: list[tuple[Phase, Phase]]) -> float:
    """The median over rounds of the first server's rate over the second's."""
    return statistics.median(first.rate / second.rate for first, second in pairs)


def alternate(first: Server, second: Server, clients: int, rounds: int, seconds: float,
              path: str = "/v1/gradients") -> list[tuple[Phase, Phase]]:
    pairs = []
    for k in range(rounds):
        pairs.append((phase(first, clients, seconds, path), phase(second, clients, seconds, path)))
        print(f"  {path} {clients} client(s), round {k + 1}: {pairs[-1][0].rate:.0f} vs {pairs[-1][1].rate:.0f} req/s",
              file=sys.stderr, flush=True)
    return pairs


def detail(pairs: list[tuple[Phase, Phase]], rounds: int, seconds: float) -> str:
    rate_s, rate_p = medians(pairs, "rate")
    cpu_s, cpu_p = medians(pairs, "cpu_ms")
    client_s, client_p = medians(pairs, "client_cpu_ms")
    return (f"{rate_s:.0f} vs {rate_p:.0f} req/s, medians of {rounds} alternating rounds of {seconds:g} s, "
            f"{WORKERS} workers each; CPU per request: workers {cpu_s:.2f} vs {cpu_p:.2f} ms, "
            f"load driver {client_s:.2f} vs {client_p:.2f} ms")


def small_requests_vs_peer(bench, rounds: int = ROUNDS, seconds: float = PHASE_S) -> list[Result]:
    """The service's requests/s over the peer's on the 10x5 example, at 1 and 4 clients; then
    the ratio taken apart and the no-op app under each one's server (info rows)."""
    results = []
    with gunicorn_server(workers=WORKERS, device="cpu", ready_path="/readyz") as service, \
            peer_server(WORKERS, bench.torch_threads) as peer:
        same_answer(service, peer)
        for server in (service, peer):  # warm-up: every worker has served before the first round
            load(server, "/v1/gradients", BODY, clients=max(CLIENTS), seconds=min(1.0, seconds))
        for clients in CLIENTS:
            pairs = alternate(service, peer, clients, rounds, seconds)
            ratio = median_ratio(pairs)
            results.append(Result(
                f"18. seed 10x5 example, {clients_label(clients)}: service vs minimal "
                f"Flask app (sync)", f">= {TARGET}x", f"{ratio:.2f}x", at_least(ratio, TARGET),
                detail(pairs, rounds, seconds)))
        results.append(Result(
            f"18. seed 10x5 example behind {WORKERS} silent connections (one per worker): the service "
            f"vs the peer (sync)", "- (info)", f"{behind_silent(service)} vs {behind_silent(peer)}", "-",
            "a sync worker reads a connection's head in its only thread, until gunicorn's timeout (30 s) "
            "ends it; the service's poller waits for heads (docs/connections.md)"))
    floor_rounds = max(1, rounds // 2 + 1)
    results += taken_apart(bench, floor_rounds, seconds)
    with gunicorn_server(workers=WORKERS, device=None, ready_path="/", app=NOOP_APP) as service, \
            peer_server(WORKERS, bench.torch_threads, app=NOOP_APP) as peer:
        for server in (service, peer):
            load(server, "/", BODY, clients=max(CLIENTS), seconds=min(1.0, seconds))
        for clients in CLIENTS:
            pairs = alternate(service, peer, clients, floor_rounds, seconds, path="/")
            ratio = median_ratio(pairs)
            results.append(Result(
                f"18. no-op WSGI app, {clients_label(clients)}: the service's server vs the "
                f"peer's (sync), the servers alone", "- (info)", f"{ratio:.2f}x", "-",
                detail(pairs, floor_rounds, seconds)))
    return results


def behind_silent(server: Server, silent: int = WORKERS) -> str:
    """The seed request's answer time behind `silent` connections open that have sent nothing
    (a sync worker each: they wait first in the peer's one listening socket), or that no answer
    came within SILENT_WAIT_S."""
    with contextlib.ExitStack() as quiet:
        try:
            for _ in range(silent):
                quiet.enter_context(socket.create_connection(("127.0.0.1", server.port), timeout=SILENT_WAIT_S))
            start = time.perf_counter()
            response = requests.post(server.url + "/v1/gradients", data=BODY, timeout=SILENT_WAIT_S,
                                     headers={"Content-Type": "application/json"})
            return f"{1e3 * (time.perf_counter() - start):.0f} ms ({response.status_code})"
        except requests.Timeout:
            return f"no answer in {SILENT_WAIT_S:g} s"
        except (requests.RequestException, OSError) as exc:  # an info row: reported, never the row's end
            return f"failed: {type(exc).__name__}"


def clients_label(clients: int) -> str:
    return f"{clients} client{'s' if clients > 1 else ''}"


def taken_apart(bench, rounds: int, seconds: float) -> list[Result]:
    """Row 18's gap in two parts, measured in the same run (info rows)."""
    results = []
    served = partial(gunicorn_server, workers=WORKERS, device="cpu", ready_path="/readyz")
    with served() as service, served(env=STOCK_GTHREAD_ENV) as stock_gthread, \
            served(env=APP_ON_SYNC_ENV) as app_on_sync, peer_server(WORKERS, bench.torch_threads) as peer:
        for server in (service, stock_gthread, app_on_sync, peer):
            load(server, "/v1/gradients", BODY, clients=max(CLIENTS), seconds=min(1.0, seconds))
        for clients in CLIENTS:
            for name, first, second in (
                    ("the service's app under gunicorn's sync worker (one thread, no gRPC) vs the peer, "
                     "the apps alone as served", app_on_sync, peer),
                    ("the service vs the same app and settings under gunicorn's stock gthread worker, "
                     "what ConnectionWorker adds", service, stock_gthread)):
                pairs = alternate(first, second, clients, rounds, seconds)
                ratio = median_ratio(pairs)
                results.append(Result(f"18. seed 10x5 example, {clients_label(clients)}: {name}", "- (info)",
                                      f"{ratio:.2f}x", "-", detail(pairs, rounds, seconds)))
    return results
