"""The benchmark's rows, one function each: `row(bench) -> list[Result]`.

Targets are the issue's (issue 5); a row never loosens one. In-process work
runs with one gunicorn worker's torch threads (see Bench.__init__).
"""
import contextlib
import dataclasses
import statistics
import threading
import time

import numpy as np
import orjson
import requests
import torch

from blockgrad_client.infer import binary_infer_request, read_infer_response
from tools.reference import REFERENCE_OBJECTIVES, batch_matrix, concat_matrix, reference_accumulated, reference_blocks
from tools.server import Server, gunicorn_server

from app.core.request import default_factor
from app.core.run import Deadline, run
from app.core.settings import Settings

from . import inprocess, workloads
from .measure import Result, at_least, at_most, clients_rate, median_time, ms, paired, timed

MB = 1024 * 1024


@contextlib.contextmanager
def served():
    """gunicorn as `make serve` runs it (workers and device from its config), ready to measure."""
    with gunicorn_server(workers=None, device=None, ready_path="/readyz") as server:
        # Every worker imports the app at boot; give each time to finish before measuring.
        for _ in range(4 * server.workers):
            server.answers("/readyz")
        yield server


class Bench:
    """What rows share: the thread count, and one long-lived server for the HTTP rows."""

    def __init__(self, torch_threads: int):
        self.torch_threads = torch_threads
        torch.set_num_threads(torch_threads)
        self._servers = contextlib.ExitStack()
        self._server: Server | None = None

    def server(self) -> Server:
        if self._server is None:
            self._server = self._servers.enter_context(served())
        return self._server

    def close(self) -> None:
        self._servers.close()


def post(session: requests.Session, url: str, body: bytes) -> bytes | int:
    """POST a JSON body and read the whole answer; returns its size in bytes."""
    with session.post(url + "/v1/gradients", data=body, stream=True, timeout=300,
                      headers={"Content-Type": "application/json"}) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.content[:500]!r}")
        return sum(len(chunk) for chunk in response.iter_content(1 << 20))


def post_for_body(url: str, body: bytes) -> bytes:
    response = requests.post(url + "/v1/gradients", data=body, timeout=300,
                             headers={"Content-Type": "application/json"})
    if response.status_code != 200:
        raise RuntimeError(f"HTTP {response.status_code}: {response.content[:500]!r}")
    return response.content


# 1. ---------------------------------------------------------------------------------------
def engine_vs_seed(bench: Bench) -> list[Result]:
    n, dim, factor, target = 512, 64, 16, 50.0
    matrix = workloads.vectors(n, dim)
    req = inprocess.request(matrix, factor)
    seed_vectors = torch.as_tensor(matrix, dtype=torch.float32)

    def seed_loop():  # the seed's literal loops: shared graph for the sum, detach per block
        reference_blocks(seed_vectors, factor, "sum")
        return reference_accumulated(seed_vectors, factor, "sum")

    _, seed_acc = timed(seed_loop)  # warm-up, and the answer to check the engine against
    torch.testing.assert_close(inprocess.engine(req), seed_acc, rtol=2e-5, atol=2e-5)
    seed_s = median_time(seed_loop, repeats=3, budget_s=40)
    engine_s = median_time(lambda: inprocess.engine(req), repeats=5)
    ratio = seed_s / engine_s
    return [Result(f"1. engine vs literal seed loop, N={n} D={dim} F={factor}", f">= {target:.0f}x",
                   f"{ratio:.0f}x", at_least(ratio, target),
                   f"seed {seed_s:.2f} s, engine {ms(engine_s)} (both passes)")]


# 2. ---------------------------------------------------------------------------------------
def http_vs_floor(bench: Bench) -> list[Result]:
    """The issue's two requests use the default objective (sum), whose block gradients are
    views of one number, so the service keeps them from pass one; the third request has
    dense gradients (sum_of_squares) and shows the cost of pass two recomputing them."""
    target, results = 1.3, []
    for n, dim, factor, objective in ((128, 64, 4, "sum"), (512, 64, 16, "sum"), (512, 64, 16, "sum_of_squares")):
        issue_row = objective == "sum"  # the issue's rows; the dense one is for information
        row = http_floor_row(bench, n, dim, factor, objective,
                             f"2. HTTP vs in-process floor, N={n} D={dim} F={factor}, both outputs, {objective}",
                             f"<= {target}x" if issue_row else "- (info)", target if issue_row else None,
                             repeats=9 if n < 512 else 5)
        if not issue_row:
            row = dataclasses.replace(row, detail=row.detail + "; dense gradients: pass two recomputes them")
        results.append(row)
    return results


# 3. ---------------------------------------------------------------------------------------
def small_requests(bench: Bench) -> list[Result]:
    server = bench.server()
    body = workloads.body(workloads.SEED_EXAMPLE)
    results = []
    for clients, per_client in ((1, 300), (4, 150)):  # bounded in count and time
        rate, median, count = clients_rate(lambda: (lambda s=requests.Session(): post(s, server.url, body)), clients,
                                           15, per_client, warm=5)
        results.append(Result(f"3. seed 10x5 example, {clients} client{'s' if clients > 1 else ''}", "-",
                              f"{rate:.0f} req/s", "-",
                              f"median latency {ms(median)}, {count} requests"))
    return results


# 4. ---------------------------------------------------------------------------------------
def peak_worker_rss(bench: Bench) -> list[Result]:
    cases = (  # (name, N, D, F, outputs, limit in bytes)
        ("accumulated only", 4096, 64, 64, ["accumulated"], 600 * MB),
        ("full (blocks, accumulated)", 512, 64, 16, ["blocks", "accumulated"], 1536 * MB),
    )
    results = []
    for name, n, dim, factor, outputs, limit in cases:
        body = workloads.body(workloads.vectors(n, dim), factor=factor, outputs=outputs)
        with served() as server:  # fresh workers: the peak belongs to this one request
            idle = server.worker_peak_rss_bytes()
            elapsed, size = timed(lambda: post(requests.Session(), server.url, body))
            peak = server.worker_peak_rss_bytes()
        results.append(Result(f"4. peak worker RSS, N={n} D={dim} F={factor}, {name}",
                              f"< {limit / MB:.0f} MB", f"{peak / MB:.0f} MB", at_most(peak, limit - 1),
                              f"idle worker {idle / MB:.0f} MB; body {len(body) / MB:.1f} MiB in, "
                              f"{size / MB:.1f} MiB out, {elapsed:.2f} s"))
    return results


# 5. ---------------------------------------------------------------------------------------
def parse_vs_loads(bench: Bench) -> list[Result]:
    n, dim, target = 4096, 64, 3.0
    body = workloads.body(workloads.vectors(n, dim), factor=64, outputs=["accumulated"])
    inprocess.parse_and_validate(body)  # warm-up
    times = paired(lambda: inprocess.parse_and_validate(body), lambda: orjson.loads(body), repeats=11)
    return [Result(f"5. parse + validate vs orjson.loads, {n}x{dim}", f"<= {target:.0f}x",
                   f"{times.ratio:.2f}x", at_most(times.ratio, target),
                   f"loads + schema {ms(times.a_s)}, loads {ms(times.b_s)}, {len(body) / MB:.1f} MiB")]


# Issue 4 ------------------------------------------------------------------------------------
def binary_infer(session: requests.Session, url: str, body: bytes, headers: dict) -> tuple[dict, dict]:
    """POST a binary /v2 infer request and decode the answer's tensors (as a client must)."""
    response = session.post(url + "/v2/models/blockgrad/infer", data=body, headers=headers, timeout=300)
    if response.status_code != 200:
        raise RuntimeError(f"HTTP {response.status_code}: {response.content[:500]!r}")
    return read_infer_response(response.content, response.headers)


def json_answer(session: requests.Session, url: str, body: bytes) -> dict:
    """POST to /v1/gradients and parse the whole JSON answer (as a client must)."""
    response = session.post(url + "/v1/gradients", data=body, timeout=300, headers={"Content-Type": "application/json"})
    if response.status_code != 200:
        raise RuntimeError(f"HTTP {response.status_code}: {response.content[:500]!r}")
    return orjson.loads(response.content)


def v2_binary_infer(bench: Bench) -> list[Result]:
    """Binary tensors (/v2) against JSON: both end to end through gunicorn, the client's
    decoding included, and against the in-process JSON floor (engine + orjson.dumps)."""
    server, results = bench.server(), []
    session = requests.Session()
    # (a) N=256, D=64, F=8, all outputs: binary infer vs the same answer as JSON from /v1.
    n, dim, factor, target = 256, 64, 8, 5.0
    matrix = workloads.vectors(n, dim).astype("float32")
    body, headers = binary_infer_request(matrix, {"factor": factor})
    json_body = workloads.body(matrix, factor=factor, outputs=["blocks", "accumulated", "losses"])
    _, tensors = binary_infer(session, server.url, body, headers)  # warm-up, and proof of the same numbers
    answer = json_answer(session, server.url, json_body)
    if not (tensors["accumulated"] == np.array(answer["accumulated"], dtype=np.float32)).all():
        raise RuntimeError("/v2 and /v1 disagree on the accumulated gradient")
    times = paired(lambda: json_answer(session, server.url, json_body),
                   lambda: binary_infer(session, server.url, body, headers), repeats=7)
    # The same two requests, bytes only (no decoding on the client), for comparison.
    raw = paired(lambda: session.post(server.url + "/v1/gradients", data=json_body, timeout=300,
                                      headers={"Content-Type": "application/json"}).content,
                 lambda: session.post(server.url + "/v2/models/blockgrad/infer", data=body, headers=headers,
                                      timeout=300).content, repeats=5)
    results.append(Result(f"4a. binary /v2 infer vs /v1 JSON, N={n} D={dim} F={factor}, all outputs",
                          f">= {target:.0f}x", f"{times.ratio:.1f}x", at_least(times.ratio, target),
                          f"JSON {ms(times.a_s)}, binary {ms(times.b_s)}, the client decoding to arrays; "
                          f"bytes only: {raw.ratio:.1f}x ({ms(raw.a_s)} vs {ms(raw.b_s)})"))
    # (b) N=128, D=64, F=4: binary infer vs the in-process JSON floor.
    n, dim, factor, target = 128, 64, 4, 0.5
    matrix = workloads.vectors(n, dim).astype("float32")
    body, headers = binary_infer_request(matrix, {"factor": factor})
    req = inprocess.request(matrix.astype("float64"), factor)
    binary_infer(session, server.url, body, headers)  # warm-up
    times = paired(lambda: binary_infer(session, server.url, body, headers),
                   lambda: inprocess.floor_body(req), repeats=9)
    results.append(Result(f"4b. binary /v2 infer vs in-process JSON floor, N={n} D={dim} F={factor}",
                          f"<= {target}x", f"{times.ratio:.2f}x", at_most(times.ratio, target),
                          f"binary over HTTP {ms(times.a_s)}, floor {ms(times.b_s)}"))
    return results


# 7. ---------------------------------------------------------------------------------------
SERVING_CLIENTS = 4
SERVING_SECONDS = 6.0  # per configuration, after a warm-up; bounded in count too
PROBE_EVERY_S = 0.05


def load(server: Server, path: str, body: bytes, probe: bool = False, clients: int = SERVING_CLIENTS,
         seconds: float = SERVING_SECONDS) -> tuple[float, list[float], list[float]]:
    """`clients` threads, each with its own Session, POSTing `body` back to back for
    `seconds`; with `probe`, one more thread times GET /readyz every PROBE_EVERY_S.
    Returns (requests per second, client latencies, probe latencies)."""
    latencies, probes, lock = [], [], threading.Lock()
    stop = threading.Event()

    def client():
        mine = []
        with requests.Session() as session:
            for _ in range(5):  # warm the connection and the worker
                session.post(server.url + path, data=body, headers={"Content-Type": "application/json"}, timeout=60)
            end = time.monotonic() + seconds
            for _ in range(100_000):
                start = time.perf_counter()
                response = session.post(server.url + path, data=body, timeout=60,
                                        headers={"Content-Type": "application/json"})
                if response.status_code != 200:
                    raise RuntimeError(f"HTTP {response.status_code}: {response.content[:300]!r}")
                mine.append(time.perf_counter() - start)
                if time.monotonic() > end:
                    break
        with lock:
            latencies.extend(mine)

    def prober():
        with requests.Session() as session:
            while not stop.wait(PROBE_EVERY_S):
                start = time.perf_counter()
                session.get(server.url + "/readyz", timeout=60)
                probes.append(time.perf_counter() - start)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    watcher = threading.Thread(target=prober) if probe else None
    start = time.perf_counter()
    for thread in threads + ([watcher] if watcher else []):
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    stop.set()
    if watcher:
        watcher.join()
    return len(latencies) / wall, latencies, probes


def logged_requests(server: Server, route: str) -> list[dict]:
    """The request log's lines for `route`, oldest first."""
    return [line for line in map(orjson.loads, (
        raw for raw in server.log().splitlines() if raw.startswith('{"ts"'))) if line.get("route") == route]


def medians_ms(lines: list[dict]) -> tuple[float, float]:
    """Median duration_ms and median cpu_ms (the serving thread's CPU time) of log lines."""
    return (statistics.median(line["duration_ms"] for line in lines),
            statistics.median(line["cpu_ms"] for line in lines))


RECYCLE_ARGS = "--max-requests 100 --max-requests-jitter 10"  # the floor gunicorn.conf.py allows


def serving_small_requests(bench: Bench) -> list[Result]:
    """Issue 9: the 10 x 5 example with 4 clients, gthread (this configuration) against the
    sync worker on the same commit and against a no-op WSGI app served the same way; the
    server-side time per request under that load and with one client; the longest wait
    while workers recycle every ~100 requests."""
    body = workloads.body(workloads.SEED_EXAMPLE)
    with gunicorn_server(workers=None, device=None, ready_path="/readyz") as server:
        rate, latencies, probes = load(server, "/v1/gradients", body, probe=True)
        loaded = logged_requests(server, "/v1/gradients")
        load(server, "/v1/gradients", body, clients=1, seconds=SERVING_SECONDS / 2)
        alone = logged_requests(server, "/v1/gradients")[len(loaded):]
    sync_env = {"GUNICORN_CMD_ARGS": "--worker-class sync --threads 1 --keep-alive 2"}
    with gunicorn_server(workers=None, device=None, ready_path="/readyz", env=sync_env) as server:
        sync_rate, _, _ = load(server, "/v1/gradients", body)
    with gunicorn_server(workers=None, device=None, ready_path="/", app="bench.noop:app") as server:
        noop_rate, _, _ = load(server, "/", body)
    # What the worker class alone can give: the no-op app under sync (bounds the first row's ratio).
    with gunicorn_server(workers=None, device=None, ready_path="/", app="bench.noop:app", env=sync_env) as server:
        noop_sync_rate, _, _ = load(server, "/", body)
    with gunicorn_server(workers=None, device=None, ready_path="/readyz",
                         env={"GUNICORN_CMD_ARGS": RECYCLE_ARGS}) as server:
        recycled_rate, recycled, _ = load(server, "/v1/gradients", body)
        restarts = server.log().count("Autorestarting worker")
    p99 = float(np.percentile(probes, 99)) if probes else float("nan")
    (loaded_ms, loaded_cpu_ms), (alone_ms, alone_cpu_ms) = medians_ms(loaded), medians_ms(alone)
    return [
        Result("7. seed 10x5, 4 clients: gthread vs sync worker", ">= 2x", f"{rate / sync_rate:.2f}x",
               at_least(rate / sync_rate, 2.0), f"{rate:.0f} vs {sync_rate:.0f} req/s"),
        Result("7. seed 10x5, 4 clients: gthread vs no-op WSGI app", ">= 50%", f"{100 * rate / noop_rate:.0f}%",
               at_least(rate / noop_rate, 0.5), f"{rate:.0f} vs {noop_rate:.0f} req/s; client median "
                                               f"{ms(statistics.median(latencies))}"),
        Result("7. seed 10x5, 4 clients: server-side median per request (request log)", "<= 1 ms",
               f"{loaded_ms:.2f} ms", at_most(loaded_ms, 1.0),
               f"{len(loaded)} requests; median CPU time of the serving thread {loaded_cpu_ms:.2f} ms (cpu_ms); "
               f"2 connections per worker, so it includes the wait for the other's computation"),
        Result("7. seed 10x5, 1 client: server-side median per request (request log)", "<= 1 ms",
               f"{alone_ms:.2f} ms", at_most(alone_ms, 1.0),
               f"{len(alone)} requests; median cpu_ms {alone_cpu_ms:.2f} ms"),
        Result("7. no-op WSGI app, 4 clients: gthread vs sync worker (the most row 7's first ratio can be)",
               "- (info)", f"{noop_rate / noop_sync_rate:.2f}x", "-",
               f"{noop_rate:.0f} vs {noop_sync_rate:.0f} req/s"),
        Result("7. /readyz p99 under that load", "<= 100 ms", ms(p99), at_most(p99, 0.1),
               f"{len(probes)} probes every {PROBE_EVERY_S * 1e3:.0f} ms"),
        Result(f"7. longest request, 4 clients, workers recycling ({RECYCLE_ARGS})", "<= 1 s",
               ms(max(recycled)), at_most(max(recycled), 1.0),
               f"{restarts} restarts, {recycled_rate:.0f} req/s, p99 {ms(float(np.percentile(recycled, 99)))}"),
    ]


# 6. ---------------------------------------------------------------------------------------
def model_scorer(bench: Bench) -> list[Result]:
    """Issue 12: the example's MLP scorer (2D -> 256 -> 1) served as an objective, accumulated
    and losses at the default factor, against the same model in a plain per-block loop and
    against one forward and backward over all pairs at once."""
    from app.core.request import GradientRequest, default_factor
    from app.core.run import Deadline, run
    from app.core.settings import Settings

    from . import models

    n, dim, hidden, loop_target, floor_target = 512, 64, 256, 3.0, 1.3
    where = models.device()
    objective = models.scorer(dim, hidden)
    module = objective.module_on(where)
    factor = default_factor(n)
    matrix = workloads.vectors(n, dim)
    req = GradientRequest(vectors=matrix, factor=factor, objective="scorer", offset=5.0,
                          outputs=("accumulated", "losses"), dtype="float32", objective_fn=objective)
    vectors = torch.as_tensor(matrix, dtype=torch.float32, device=where)  # (N, D)
    settings = Settings(device=str(where))

    def engine():
        result = run(req, settings, Deadline(inprocess.NO_DEADLINE_S))
        models.sync(where)
        return result

    result = engine()  # warm-up, and the answer to check the others against
    loop_acc, loop_losses = models.block_loop(module, vectors, factor)
    scale = float(loop_acc.abs().max())
    torch.testing.assert_close(result.accumulated, loop_acc, rtol=1e-4, atol=1e-5 * scale)
    torch.testing.assert_close(result.losses, loop_losses, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(models.all_pairs_floor(module, vectors), loop_acc, rtol=1e-4, atol=1e-5 * scale)
    label = f"N={n} D={dim} F={factor}, MLP {2 * dim}->{hidden}->1, accumulated + losses, {where}"
    loop = paired(lambda: models.block_loop(module, vectors, factor), engine, repeats=3, budget_s=60)
    floor = paired(engine, lambda: models.all_pairs_floor(module, vectors), repeats=5, budget_s=60)
    return [
        Result(f"6a. model scorer: engine vs plain per-block loop, {label}", f">= {loop_target:.0f}x",
               f"{loop.ratio:.1f}x", at_least(loop.ratio, loop_target),
               f"loop {ms(loop.a_s)}, engine {ms(loop.b_s)}"),
        Result(f"6b. model scorer: engine vs all pairs at once, {label}", f"<= {floor_target}x",
               f"{floor.ratio:.2f}x", at_most(floor.ratio, floor_target),
               f"engine {ms(floor.a_s)}, floor {ms(floor.b_s)}; {objective.bytes_per_pair} activation bytes/pair"),
    ]
# Issue 10 -----------------------------------------------------------------------------------
def post_json(session: requests.Session, url: str, body: bytes) -> requests.Response:
    return session.post(url + "/v1/gradients", data=body, timeout=300, headers={"Content-Type": "application/json"})


def default_factor_vs_16(bench: Bench) -> list[Result]:
    """10a. The default factor ceil(N / 6) (29,241 blocks of ~6 rows) against factor 16 (256
    blocks of 64 rows): the same numbers, so a batched engine costs about the same."""
    n, dim, target, objective = 1024, 64, 1.5, "sum_of_squares"
    outputs = ("accumulated", "losses")
    matrix = workloads.vectors(n, dim)
    default = inprocess.request(matrix, default_factor(n), outputs=outputs, objective=objective)
    sixteen = inprocess.request(matrix, 16, outputs=outputs, objective=objective)
    # sum_of_squares' total is the same sum over all pairs at any factor: so is its gradient on V.
    torch.testing.assert_close(inprocess.answer(default), inprocess.answer(sixteen), rtol=2e-5, atol=2e-5)
    times = paired(lambda: inprocess.answer(default), lambda: inprocess.answer(sixteen), repeats=7)
    results = [Result(f"10a. default factor ({default.factor}) vs factor 16 in process, N={n} D={dim}, "
                      f"accumulated + losses, {objective}", f"<= {target}x", f"{times.ratio:.2f}x",
                      at_most(times.ratio, target), f"default {ms(times.a_s)}, factor 16 {ms(times.b_s)} "
                      f"({inprocess.DEVICE})")]
    server, session = bench.server(), requests.Session()
    bodies = [workloads.body(matrix, factor=f, objective=objective, outputs=list(outputs))
              for f in (default.factor, 16)]
    for body in bodies:  # warm-up
        if post_json(session, server.url, body).status_code != 200:
            raise RuntimeError("10a: the service refused a request the limits allow")
    http = paired(lambda: post_json(session, server.url, bodies[0]).content,
                  lambda: post_json(session, server.url, bodies[1]).content, repeats=5)
    results.append(Result("10a. the same over HTTP", "- (info)", f"{http.ratio:.2f}x", "-",
                          f"default {ms(http.a_s)}, factor 16 {ms(http.b_s)}"))
    return results


def default_factor_http_vs_floor(bench: Bench) -> list[Result]:
    """10b. Row 2 at the default factor: N=512 (86, 7,396 blocks), blocks and accumulated."""
    n, dim, target = 512, 64, 1.3
    factor = default_factor(n)
    return [http_floor_row(bench, n, dim, factor, "sum", f"10b. HTTP vs in-process floor, N={n} D={dim} "
                           f"default F={factor}, both outputs, sum", f"<= {target}x", target, repeats=5)]


def same_answer(served: bytes, floor: bytes) -> bool:
    """The same document, blocks and losses to the bit; the accumulated gradient within float
    rounding, since chunks on the pod's free slots sum it in another order (docs/cores.md)."""
    if served == floor:
        return True
    a, b = orjson.loads(served), orjson.loads(floor)
    acc_a, acc_b = np.array(a.pop("accumulated", [])), np.array(b.pop("accumulated", []))
    a.pop("device", None), b.pop("device", None)
    scale = max(1.0, float(np.abs(acc_b).max(initial=0.0)))
    return a == b and acc_a.shape == acc_b.shape and bool(np.all(np.abs(acc_a - acc_b) <= 1e-5 * scale))


def http_floor_row(bench: Bench, n: int, dim: int, factor: int, objective: str, name: str, target_text: str,
                   target: float | None, repeats: int) -> Result:
    server = bench.server()
    req = inprocess.request(workloads.vectors(n, dim), factor, objective=objective)
    body = workloads.body(req.vectors, factor=factor, objective=objective)
    floor = inprocess.floor_body(req)
    if not same_answer(post_for_body(server.url, body), floor):  # warm-up, and proof both are the same answer
        raise RuntimeError(f"N={n} F={factor}, {objective}: the service's body differs from the in-process floor's")
    session = requests.Session()
    times = paired(lambda: post(session, server.url, body), lambda: inprocess.floor_body(req), repeats=repeats)
    return Result(name, target_text, f"{times.ratio:.2f}x", at_most(times.ratio, target) if target else "-",
                  f"HTTP {ms(times.a_s)}, floor {ms(times.b_s)}, {len(floor) / MB:.0f} MiB")


def refused_then_suggested(session: requests.Session, url: str, matrix: np.ndarray, factor: int | None) -> int:
    """POST with `factor` (None: left out), expect the block limit's 413, POST again with its
    details.suggested_factor and read the 200. Returns the suggested factor."""
    fields = {"outputs": ["accumulated"]} | ({} if factor is None else {"factor": factor})
    refused = post_json(session, url, workloads.body(matrix, **fields))
    if refused.status_code != 413:
        raise RuntimeError(f"expected 413, got {refused.status_code}: {refused.content[:300]!r}")
    suggested = refused.json()["error"]["details"]["suggested_factor"]
    answer = post_json(session, url, workloads.body(matrix, **fields | {"factor": suggested}))
    if answer.status_code != 200:
        raise RuntimeError(f"factor {suggested}: HTTP {answer.status_code}: {answer.content[:300]!r}")
    return suggested


def advice_leads_somewhere_fast(bench: Bench) -> list[Result]:
    """10c/10d. The 413's suggested factor, followed as a client would, from a refused factor
    (N=1000, 334) and from the default factor (N=4096)."""
    server, session, results = bench.server(), requests.Session(), []
    n, dim, target = 1000, 64, 2.0
    matrix = workloads.vectors(n, dim)
    sixteen = workloads.body(matrix, factor=16, outputs=["accumulated"])
    suggested = refused_then_suggested(session, server.url, matrix, 334)  # warm-up
    post_json(session, server.url, sixteen)
    times = paired(lambda: refused_then_suggested(session, server.url, matrix, 334),
                   lambda: post_json(session, server.url, sixteen).content, repeats=5)
    results.append(Result(f"10c. N={n} D={dim} factor 334 -> 413 -> suggested ({suggested}) -> 200, vs factor 16",
                          f"<= {target:.0f}x", f"{times.ratio:.2f}x", at_most(times.ratio, target),
                          f"413 + suggested {ms(times.a_s)}, factor 16 {ms(times.b_s)}, accumulated only"))
    n, deadline_s = 4096, 60.0
    matrix = workloads.vectors(n, dim)
    elapsed, suggested = timed(lambda: refused_then_suggested(session, server.url, matrix, None))
    results.append(Result(f"10d. N={n} D={dim} no factor ({default_factor(n)}) -> 413 -> suggested ({suggested}) "
                          "-> 200", f"< {deadline_s:.0f} s (deadline)", f"{elapsed:.1f} s",
                          at_most(elapsed, deadline_s), "both requests, accumulated only, one run"))
    return results


def engine_vs_seed_default_factor(bench: Bench) -> list[Result]:
    """10e. Row 1 at the default factor (N=512: 86, 7,396 blocks). The seed's shared-graph
    loop allocates the whole (N, N, 2D) gradient on every backward (~0.1 s a block here), so
    it is timed over its first blocks (at most 30 s) and scaled to all of them; the seed's
    detach-per-block loop and every block's gradient are compared in full."""
    n, dim, target = 512, 64, 50.0
    factor = default_factor(n)
    matrix = workloads.vectors(n, dim)
    req = inprocess.request(matrix, factor)
    seed_vectors = torch.as_tensor(matrix, dtype=torch.float32)
    blocks_s, expected = timed(lambda: reference_blocks(seed_vectors, factor, "sum"))
    result = run_engine(req)
    for block, (loss, grad) in zip(result.blocks(), expected, strict=True):
        torch.testing.assert_close(block.gradient.cpu(), grad)
        torch.testing.assert_close(block.loss.cpu(), loss)
    done, shared_s = seed_shared_graph_prefix(seed_vectors, factor, budget_s=30.0)
    seed_s = blocks_s + shared_s * factor * factor / done
    engine_s = median_time(lambda: inprocess.engine(req), repeats=5)
    ratio = seed_s / engine_s
    return [Result(f"10e. engine vs literal seed loop, N={n} D={dim} default F={factor}", f">= {target:.0f}x",
                   f"{ratio:.0f}x", at_least(ratio, target),
                   f"seed {seed_s:.0f} s ({done} of {factor * factor} shared-graph backwards timed, scaled), "
                   f"engine {ms(engine_s)} (both passes)")]


def run_engine(req):
    return run(req, Settings(device=inprocess.DEVICE), Deadline(inprocess.NO_DEADLINE_S))


def seed_shared_graph_prefix(vectors: torch.Tensor, factor: int, budget_s: float) -> tuple[int, float]:
    """tools/reference.py's reference_accumulated, the seed's loop, stopped after budget_s:
    (blocks done, seconds)."""
    start = time.perf_counter()
    leaf = vectors.clone().requires_grad_(True)
    done = 0
    for block in batch_matrix(concat_matrix(leaf), factor=factor):
        REFERENCE_OBJECTIVES["sum"](block, 5.0).backward(retain_graph=True)
        done += 1
        if time.perf_counter() - start > budget_s:
            break
    return done, time.perf_counter() - start
