"""Issue 18's small-requests row: the README's 10 x 5 example, this service against a minimal
Flask app doing the same computation (bench/peer.py, gunicorn sync workers), side by side.

Same conditions for both: 2 workers, the same body and default outputs (blocks and accumulated,
1050 numbers), the same load driver (rows.load: each client thread its own requests.Session,
a warm-up, then back to back for a phase). Every server of the row and of its info rows runs
throughout; each comparison alternates its two servers in short phases, ABBA, so that both
phases of a round see the same seconds of a shared, noisy host, and its ratio is the median
over rounds of the round's quotient. Beside the rate, each side's workers' CPU time per
request, read from /proc, and the load driver's own (the same client code throughout: a gauge
of how busy the host is).

The info rows take the ratio apart (TAKEN_APART): the apps on the peer's sync worker; the apps
on gunicorn's stock gthread worker (a threaded server, as the connection requirements need);
what gthread costs the peer's own app; what ConnectionWorker adds to stock gthread; the no-op
WSGI app (bench/noop.py) under each side's server, the part no change to the app can move
(docs/small-requests.md). And what the threaded server buys: the seed request sent behind one
silent connection per worker (connected, nothing sent yet: a slow client, a balancer's spare).
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
ROUNDS = 12  # alternated rounds of the row, per client count (ABBA: service, peer, peer, service, ...)
INFO_ROUNDS = 6  # alternated rounds of each info row
PHASE_S = 1.5  # seconds of one server's load in one round, after its warm-up: short, so that
# both phases of a round see the same seconds of a shared host
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
# The service's keep-alive; 4 threads, not the service's pool of 30: at most two requests a
# worker are in flight in these rows, so the idle threads beyond make no difference.
PEER_GTHREAD_ARGS = "--worker-class gthread --threads 4 --keep-alive 75"
TICKS_PER_S = os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def peer_server(workers: int = WORKERS, torch_threads: int = 1, app: str = PEER_APP, cmd_args: str | None = None):
    """The peer (or `app`) under gunicorn's sync worker (or `cmd_args`' worker) on 127.0.0.1:<free port>;
    the whole process group is killed in `finally` (tools.server.stop)."""
    port = free_port()
    script = Path(sys.executable).parent / "gunicorn"
    launcher = [str(script)] if script.exists() else [sys.executable, "-m", "gunicorn"]
    command = [*launcher, "-c", PEER_CONFIG, "--bind", f"127.0.0.1:{port}", app]
    env = {**os.environ, "PEER_WORKERS": str(workers), "PEER_TORCH_THREADS": str(torch_threads)}
    env.pop("GUNICORN_CMD_ARGS", None)  # the peer's settings are its own file's, and cmd_args
    if cmd_args:
        env["GUNICORN_CMD_ARGS"] = cmd_args
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


def medians(phases: list[Phase], field: str) -> float:
    return statistics.median(getattr(p, field) for p in phases)


def alternate(first: tuple[Server, str], second: tuple[Server, str], clients: int, rounds: int,
              seconds: float, label: str) -> tuple[list[Phase], list[Phase]]:
    """A phase of each server per round, back to back, in the order ABBA ABBA ...: each
    round's two phases see the same seconds of a noisy host, and drift falls on both sides."""
    measured: tuple[list[Phase], list[Phase]] = ([], [])
    for k in range(rounds):
        order = (0, 1) if k % 2 == 0 else (1, 0)
        for side in order:
            server, path = (first, second)[side]
            measured[side].append(phase(server, clients, seconds, path))
        print(f"  {label}, {clients} client(s), round {k + 1}: {measured[0][-1].rate:.0f} vs "
              f"{measured[1][-1].rate:.0f} req/s", file=sys.stderr, flush=True)
    return measured


def compared(name: str, target: str, measured: tuple[list[Phase], list[Phase]], seconds: float,
             bar: float | None = None) -> Result:
    """A row: the median over rounds of the first server's rate over the second's, and beside
    it the medians of each side's rate and CPU per request."""
    a, b = measured
    quotient = statistics.median(x.rate / y.rate for x, y in zip(a, b, strict=True))
    detail = (f"{medians(a, 'rate'):.0f} vs {medians(b, 'rate'):.0f} req/s, medians of {len(a)} alternated "
              f"rounds of {seconds:g} s, {WORKERS} workers each; CPU per request: workers "
              f"{medians(a, 'cpu_ms'):.2f} vs {medians(b, 'cpu_ms'):.2f} ms, load driver "
              f"{medians(a, 'client_cpu_ms'):.2f} vs {medians(b, 'client_cpu_ms'):.2f} ms")
    verdict = "-" if bar is None else at_least(quotient, bar)
    return Result(name, target, f"{quotient:.2f}x", verdict, detail)


# Row 18's ratio taken apart (info rows): (first, second, the row's name), each alternated as the row is.
SEED = "seed 10x5 example, {clients}: "
TAKEN_APART = (
    ("app_on_sync", "peer", SEED + "the service's app under gunicorn's sync worker (one thread, no gRPC) vs "
     "the peer, the apps alone on the peer's server"),
    ("stock_gthread", "peer_gthread", SEED + "the service's app vs the peer's, both under gunicorn's stock "
     "gthread worker, the apps alone on a threaded server"),
    ("peer_gthread", "peer", SEED + "the peer under gunicorn's stock gthread worker vs under sync, what a "
     "threaded server costs the peer's own app"),
    ("service", "stock_gthread", SEED + "the service vs the same app and settings under gunicorn's stock "
     "gthread worker, what ConnectionWorker adds"),
    ("noop_service", "noop_peer", "no-op WSGI app, {clients}: the service's server vs the peer's (sync), "
     "the servers alone"),
)


def small_requests_vs_peer(bench, rounds: int = ROUNDS, seconds: float = PHASE_S) -> list[Result]:
    """The service's requests/s over the peer's on the 10x5 example, at 1 and 4 clients; then
    the ratio taken apart and the servers alone (info rows), every server running throughout."""
    served = partial(gunicorn_server, workers=WORKERS, device="cpu", ready_path="/readyz")
    peer = partial(peer_server, WORKERS, bench.torch_threads)
    with contextlib.ExitStack() as stack:
        servers = {name: (stack.enter_context(start), path) for name, start, path in (
            ("service", served(), "/v1/gradients"), ("peer", peer(), "/v1/gradients"),
            ("app_on_sync", served(env=APP_ON_SYNC_ENV), "/v1/gradients"),
            ("stock_gthread", served(env=STOCK_GTHREAD_ENV), "/v1/gradients"),
            ("peer_gthread", peer(cmd_args=PEER_GTHREAD_ARGS), "/v1/gradients"),
            ("noop_service", gunicorn_server(workers=WORKERS, device=None, ready_path="/", app=NOOP_APP), "/"),
            ("noop_peer", peer(app=NOOP_APP), "/"))}
        same_answer(servers["service"][0], servers["peer"][0])
        for server, path in servers.values():  # warm-up: every worker has served before the first round
            load(server, path, BODY, clients=max(CLIENTS), seconds=1.0)
        results, info = [], []
        for clients in CLIENTS:
            results.append(compared(
                f"18. seed 10x5 example, {clients_label(clients)}: service vs minimal Flask app (sync)",
                f">= {TARGET}x",
                alternate(servers["service"], servers["peer"], clients, rounds, seconds, "service vs peer"),
                seconds, TARGET))
            info += [compared(f"18. {what.format(clients=clients_label(clients))}", "- (info)",
                              alternate(servers[first], servers[second], clients, INFO_ROUNDS, seconds,
                                        f"{first} vs {second}"),
                              seconds)
                     for first, second, what in TAKEN_APART]
        results.append(Result(
            f"18. seed 10x5 example behind {WORKERS} silent connections (one per worker): the service "
            f"vs the peer (sync)", "- (info)",
            f"{behind_silent(servers['service'][0])} vs {behind_silent(servers['peer'][0])}", "-",
            "a sync worker reads a connection's head in its only thread, until gunicorn's timeout (30 s) "
            "ends it; the service's poller waits for heads (docs/connections.md)"))
    return results + info


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
