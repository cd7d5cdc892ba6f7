"""Job rows J1-J8 (docs/jobs.md, "Benchmarks"): each starts gunicorn as `make serve` does,
with its embedded Dask cluster (BLOCKGRAD_DASK_WORKERS workers at nice 19), and stops it.

A job's compute time is its record's finished_at - started_at (the first tile's start to the
last sum's end); submit-to-result is POST to the result's last byte, polling the record.
Every row also reports the machine's load average: the embedded workers run at nice 19 and
yield to anything else running, so on a shared machine a job gets what is left.

J3 (N = 65,536, 4.3 x 10^9 pairs) takes about half an hour on two idle cores, more
than `make bench` should grow by: it runs when named (`python -m bench job_size`) or with
BLOCKGRAD_BENCH_J3=1, and otherwise reports that it was not run.

`python -m bench.jobs TP` profiles one tile (in this process, on a Dask worker untuned and tuned).

J5 downloads a stored result with six clients at once and reads the web worker's peak memory.

J6 times a POST, a GET and a scrape against a store of 10,000 kept jobs and one of 30.

J7 reads the runner's peak memory while it stores the largest result admitted.

J8 reads the CPU an idle embedded cluster uses, with app/jobs/cluster.py's IDLE_CONFIG and with
distributed's defaults, both servers idle at once.

Usage: python -m bench.jobs [J1 J2 J3 J4 J5 J6 J7 J8 TP]
"""
import contextlib
import io
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np
import requests
import torch

from tools.job_rows import add_finished_jobs
from tools.server import children, cpu_ticks, gunicorn_server, peak_rss_kib, rss_kib, wait_until

from .measure import Result, all_started_together, at_least, at_most, paired
from .workloads import body as json_body
from .workloads import vectors as random_vectors

CLUSTER_UP_S = 180  # bounded: the scheduler and niced workers start while gunicorn does
JOB_LIMIT_S = 3600
J1_COMPUTE_RATIO, J1_EXTRA_S = 1.3, 0.5
J2_SHARE = 0.9
J3_ENV = "BLOCKGRAD_BENCH_J3"


def load() -> str:
    return "load " + " ".join(f"{x:.1f}" for x in os.getloadavg())


@contextlib.contextmanager
def job_server(dask_workers: int, **env: str):
    """gunicorn (2 workers) with its embedded cluster of `dask_workers`, every worker joined
    (a first small job done, and the runner's count of workers on /metrics)."""
    settings = {"BLOCKGRAD_DASK_SCHEDULER": "", "BLOCKGRAD_DASK_WORKERS": str(dask_workers), **env}
    with gunicorn_server(workers=2, env=settings) as server:
        url = server.url
        tiny = requests.post(url + "/v1/jobs", json={"vectors": [[1.0, 2.0], [3.0, 4.0]], "factor": 2}, timeout=30)
        tiny.raise_for_status()
        wait_for(url, tiny.json()["id"], CLUSTER_UP_S, 0.2)

        def all_joined():
            text = requests.get(url + "/metrics", timeout=10).text
            return f"blockgrad_cluster_workers {float(dask_workers)}" in text
        if not wait_until(all_joined, CLUSTER_UP_S, 1.0):
            raise RuntimeError(f"{dask_workers} Dask workers did not all join within {CLUSTER_UP_S} s")
        yield server


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (a nanny starts its worker process from a thread: every task's children)."""
    found, todo = [], [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                kids = [int(child) for child in (task / "children").read_text().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


def dask_workers(server) -> list[int]:
    """The Dask worker processes (each its nanny's child, under the cluster's supervisor)."""
    workers = []
    for pid in descendants(server.pid):
        try:
            line = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in line or line.startswith(b"dask worker ["):  # the title setproctitle gives it
            workers.append(pid)
    return workers


def workers_cpu_s(server) -> float:
    """CPU seconds the embedded Dask workers have used: on a shared machine, what a job got."""
    return sum(cpu_ticks(pid) for pid in dask_workers(server)) / os.sysconf("SC_CLK_TCK")


def gunicorn_workers_cpu_s(server) -> float:
    """CPU seconds gunicorn's workers have used (a synchronous request's compute is theirs)."""
    return sum(cpu_ticks(pid) for pid in children(server.pid)) / os.sysconf("SC_CLK_TCK")


def seconds(rfc3339: str) -> float:
    return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()


def wait_for(url: str, job_id: str, timeout_s: float, interval_s: float) -> dict:
    record = {}

    def finished():
        nonlocal record
        record = requests.get(f"{url}/v1/jobs/{job_id}", timeout=30).json()
        return record.get("status") not in ("queued", "running")
    if not wait_until(finished, timeout_s, interval_s):
        raise RuntimeError(f"job {job_id} not done within {timeout_s} s: {record}")
    if record["status"] != "succeeded":
        raise RuntimeError(f"job {job_id} {record['status']}: {record.get('error')}")
    return record


@dataclass(frozen=True)
class JobTime:
    submit_to_result_s: float
    compute_s: float
    record: dict
    result: bytes


def run_job(url: str, data: bytes, query: str = "", npy: bool = False, poll_s: float = 0.05,
            keep: bool = False) -> JobTime:
    """One job, submit to its whole result; the result as a .npz. Then deleted, unless `keep`."""
    headers = {"Content-Type": "application/x-npy" if npy else "application/json"}
    began = time.perf_counter()
    created = requests.post(f"{url}/v1/jobs{query}", data=data, headers=headers, timeout=300)
    if created.status_code != 202:
        raise RuntimeError(f"HTTP {created.status_code}: {created.text[:300]}")
    record = wait_for(url, created.json()["id"], JOB_LIMIT_S, poll_s)
    result = requests.get(f"{url}/v1/jobs/{record['id']}/result", headers={"Accept": "application/x-npz"},
                          timeout=300)
    result.raise_for_status()
    total = time.perf_counter() - began
    if not keep:
        requests.delete(f"{url}/v1/jobs/{record['id']}", timeout=30)
    return JobTime(total, seconds(record["finished_at"]) - seconds(record["started_at"]), record, result.content)


def post_sync(url: str, body: bytes) -> float:
    began = time.perf_counter()
    response = requests.post(url + "/v1/gradients", data=body, headers={"Content-Type": "application/json"},
                             timeout=900)
    if response.status_code != 200:
        raise RuntimeError(f"HTTP {response.status_code}: {response.content[:300]!r}")
    return time.perf_counter() - began


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def arrays(job: JobTime) -> dict[str, np.ndarray]:
    return dict(np.load(io.BytesIO(job.result), allow_pickle=False))


# J1 ---------------------------------------------------------------------------------------
def truncate_wal(store: Path) -> None:
    """Empty the SQLite store's write-ahead log: what the next job writes is all that is in it."""
    import sqlite3

    with contextlib.closing(sqlite3.connect(store, timeout=30)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def wal_writes(store: Path) -> tuple[int, int]:
    """(transactions committed, bytes of pages written) in the store's WAL since truncate_wal:
    its frames, a commit frame carrying the database's size (SQLite's WAL format)."""
    wal = Path(f"{store}-wal")
    data = wal.read_bytes() if wal.exists() else b""
    if len(data) < 32:
        return 0, 0
    page = int.from_bytes(data[8:12], "big")
    frames = (len(data) - 32) // (24 + page)
    commits = sum(1 for k in range(frames) if int.from_bytes(data[32 + k * (24 + page) + 4:][:4], "big"))
    return commits, frames * page


def job_overhead(bench=None, n: int = 1024, dim: int = 64, factor: int = 16, repeats: int = 3) -> list[Result]:
    """A small job against the same synchronous request, medians of `repeats` alternating runs;
    and what one job writes into the store (its SQLite write-ahead log, read between jobs)."""
    body = json_body(random_vectors(n, dim), factor=factor, outputs=["accumulated"])
    with tempfile.TemporaryDirectory() as data_dir, job_server(2, BLOCKGRAD_DATA_DIR=data_dir) as server:
        store = Path(data_dir) / "jobs.sqlite3"
        post_sync(server.url, body)  # warm: a worker has computed once
        sync, jobs, sync_cpu, job_cpu, writes = [], [], 0.0, 0.0, []
        for _ in range(repeats):
            cpu = gunicorn_workers_cpu_s(server)
            sync.append(post_sync(server.url, body))
            sync_cpu += gunicorn_workers_cpu_s(server) - cpu
            cpu = workers_cpu_s(server)
            truncate_wal(store)
            jobs.append(run_job(server.url, body, keep=True))
            writes.append(wal_writes(store))
            requests.delete(f"{server.url}/v1/jobs/{jobs[-1].record['id']}", timeout=30)
            job_cpu += workers_cpu_s(server) - cpu
        state = load()
    commits, written = min(writes)
    t_sync = statistics.median(sync)
    compute = statistics.median(job.compute_s for job in jobs)
    total = statistics.median(job.submit_to_result_s for job in jobs)
    name = f"J1. job overhead, N={n} D={dim} F={factor} accumulated, 2 Dask workers"
    return [
        Result(name + ": job compute / synchronous request", f"<= {J1_COMPUTE_RATIO}x", f"{compute / t_sync:.2f}x",
               at_most(compute / t_sync, J1_COMPUTE_RATIO),
               f"job compute {compute * 1e3:.0f} ms, synchronous {t_sync * 1e3:.0f} ms; CPU per run: Dask workers "
               f"{job_cpu / repeats * 1e3:.0f} ms, gunicorn workers {sync_cpu / repeats * 1e3:.0f} ms "
               f"({job_cpu / max(sync_cpu, 1e-9):.2f}x); {load()}"),
        Result(name + ": submit-to-result - synchronous", f"<= +{J1_EXTRA_S} s", f"+{total - t_sync:.2f} s",
               at_most(total - t_sync, J1_EXTRA_S),
               f"submit to result {total * 1e3:.0f} ms (polling every 50 ms); the store's writes per job "
               f"(POST to result, the fewest of {repeats}): {commits} transactions, {written / 1024:.0f} KiB of pages "
               f"(vectors {n * dim * 4 // 1024} KiB in, accumulated {n * dim * 4 // 1024} KiB out); {state}"),
    ]


# J2 ---------------------------------------------------------------------------------------
def job_scaling(bench=None, n: int = 8192, dim: int = 64, factor: int = 64) -> list[Result]:
    """S_job = t(1 Dask worker) / t(2), against 0.9 x S_pair = 2 t(one request) / t(two at once),
    synchronous with one slot per request, all in this run."""
    matrix = random_vectors(n, dim).astype(np.float32)
    body = json_body(matrix, factor=factor, objective="sum_of_squares", outputs=["accumulated"])
    sync_env = {"BLOCKGRAD_SLOTS_PER_REQUEST": "1", "BLOCKGRAD_REQUEST_TIMEOUT_S": "900"}
    with gunicorn_server(workers=2, env=sync_env) as server:
        cpu = gunicorn_workers_cpu_s(server)
        alone = post_sync(server.url, body)
        alone_cpu = gunicorn_workers_cpu_s(server) - cpu
        pair = all_started_together([lambda: post_sync(server.url, body)] * 2)
    sync_load = load()
    data, query = npy_bytes(matrix), f"?factor={factor}&objective=sum_of_squares&outputs=accumulated"
    times, cpus = {}, {}
    for workers in (1, 2):
        with job_server(workers) as server:
            cpu = workers_cpu_s(server)
            times[workers] = run_job(server.url, data, query, npy=True, poll_s=0.5)
            cpus[workers] = workers_cpu_s(server) - cpu
    s_pair = 2 * alone / pair
    s_job = times[1].compute_s / times[2].compute_s
    return [Result(f"J2. job scaling, N={n} D={dim} F={factor} sum_of_squares accumulated: 2 Dask workers vs 1",
                   f">= {J2_SHARE} x S_pair", f"{s_job:.2f} vs {s_pair:.2f} ({s_job / s_pair:.2f})",
                   at_least(s_job, J2_SHARE * s_pair),
                   f"job compute 1 worker {times[1].compute_s:.1f} s, 2 workers {times[2].compute_s:.1f} s (submit "
                   f"to result {times[1].submit_to_result_s:.1f} / {times[2].submit_to_result_s:.1f} s); "
                   f"bound: synchronous 1-slot request {alone:.1f} s, two at once {pair:.1f} s, S_pair "
                   f"{s_pair:.2f}, 0.9 x S_pair {J2_SHARE * s_pair:.2f}; CPU: 1-worker job {cpus[1]:.1f} s, "
                   f"2-worker job {cpus[2]:.1f} s, synchronous request {alone_cpu:.1f} s (1-worker job / "
                   f"synchronous {cpus[1] / max(alone_cpu, 1e-9):.2f}x); work per second, 2-worker job vs two "
                   f"synchronous requests at once: {pair / (2 * times[2].compute_s):.2f}x; {sync_load} (sync), "
                   f"{load()} (jobs)")]


# J3 ---------------------------------------------------------------------------------------
def job_size(bench=None, n: int = 65536, dim: int = 64, factor: int = 256, named: bool = False) -> list[Result]:
    """The largest row: time, pairs per second and each Dask worker's peak memory (VmHWM)."""
    name = f"J3. job size, N={n} D={dim} F={factor} sum accumulated + losses, 2 Dask workers"
    if not named and os.environ.get(J3_ENV) != "1":
        return [Result(name, "finishes", "not run", "-",
                       f"about 30 min on 2 idle cores (docs/jobs.md); {J3_ENV}=1 runs it")]
    matrix = np.random.default_rng(3).standard_normal((n, dim)).astype(np.float32)
    with job_server(2) as server:
        idle = {pid: peak_rss_kib(pid) for pid in dask_workers(server)}
        cpu = workers_cpu_s(server)
        job = run_job(server.url, npy_bytes(matrix), f"?factor={factor}&objective=sum", npy=True, poll_s=1.0)
        cpu = workers_cpu_s(server) - cpu
        peaks = {pid: peak_rss_kib(pid) for pid in dask_workers(server)}
    got = arrays(job)
    exact = bool(np.all(got["accumulated"] == 2 * n))  # sum: every gradient entry is 1
    peak_text = ", ".join(f"{peaks[pid] / 1024:.0f} MiB (idle {idle.get(pid, 0) / 1024:.0f})" for pid in sorted(peaks))
    return [Result(name, "finishes", f"{job.submit_to_result_s:.0f} s", "PASS" if exact else "MISS",
                   f"{n * n / job.compute_s / 1e6:.2f} M pairs/s (compute {job.compute_s:.0f} s; workers' CPU "
                   f"{cpu:.0f} s, {n * n / cpu / 1e6:.2f} M pairs per CPU second); workers' peak "
                   f"RSS {peak_text}; accumulated exactly 2N: {exact}; {load()}")]


# J4 ---------------------------------------------------------------------------------------
def sync_model_rate(objective, dim: int, side: int) -> tuple[float, float]:
    """Pairs per second and per CPU second of the synchronous engine on one core (in this
    process, one torch thread), accumulated + losses, on blocks of the job's shape (side x side)."""
    from app.core.request import GradientRequest
    from app.core.run import Deadline, run
    from app.core.settings import Settings

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n = 4 * side
        req = GradientRequest(vectors=random_vectors(n, dim).astype(np.float32), factor=4, objective=objective.name,
                              offset=5.0, outputs=("accumulated", "losses"), dtype="float32", objective_fn=objective)
        run(req, Settings(device="cpu"), Deadline(3600.0)).accumulated  # warm
        began, cpu = time.perf_counter(), time.process_time()
        run(req, Settings(device="cpu"), Deadline(3600.0)).accumulated
        return n * n / (time.perf_counter() - began), n * n / (time.process_time() - cpu)
    finally:
        torch.set_num_threads(threads)


def job_model(bench=None, n: int = 16384, dim: int = 64, factor: int = 64, hidden: int = 256) -> list[Result]:
    """The example scorer as a job against the synchronous engine's rate on one core."""
    from app.core.models import load_models
    from app.core.objectives import OBJECTIVES
    from examples.export_scorer import export_scorer

    with tempfile.TemporaryDirectory() as models:
        export_scorer(Path(models) / "relnet.pt2", dim, hidden)
        scorer = load_models(models, OBJECTIVES)["relnet"]
        sync_rate, sync_cpu_rate = sync_model_rate(scorer, dim, n // factor)
        matrix = random_vectors(n, dim).astype(np.float32)
        with job_server(2, BLOCKGRAD_MODEL_DIR=models) as server:
            cpu = workers_cpu_s(server)
            job = run_job(server.url, npy_bytes(matrix), f"?factor={factor}&objective=relnet", npy=True, poll_s=1.0)
            cpu = workers_cpu_s(server) - cpu
    rate = n * n / job.compute_s
    return [Result(f"J4. model job, N={n} D={dim} F={factor}, example scorer (MLP {2 * dim}->{hidden}->1), "
                   "2 Dask workers: pairs/s vs the synchronous engine on one core", "- (info)",
                   f"{rate / sync_rate:.2f}x", "-",
                   f"job {rate / 1e3:.0f} K pairs/s (compute {job.compute_s:.0f} s, submit to result "
                   f"{job.submit_to_result_s:.0f} s), synchronous one core {sync_rate / 1e3:.0f} K pairs/s "
                   f"(N={4 * (n // factor)} F=4, the same blocks); per CPU second: job {n * n / cpu / 1e3:.0f} K, "
                   f"synchronous {sync_cpu_rate / 1e3:.0f} K; {load()}")]


# TP: a tile's profile (docs/jobs.md, "Throughput"), run only when named -----------------------
def thread_cost(fn, repeats: int = 3) -> dict:
    """This thread's user and system CPU seconds and minor page faults for fn(), the fastest of `repeats`."""
    import resource

    best = None
    for _ in range(repeats):
        before, began = resource.getrusage(resource.RUSAGE_THREAD), time.perf_counter()
        fn()
        wall, after = time.perf_counter() - began, resource.getrusage(resource.RUSAGE_THREAD)
        row = {"wall": round(wall, 3), "user": round(after.ru_utime - before.ru_utime, 3),
               "sys": round(after.ru_stime - before.ru_stime, 3), "faults": after.ru_minflt - before.ru_minflt}
        best = row if best is None or wall < best["wall"] else best
    return best


def tile_costs(n: int = 8192, dim: int = 64, factor: int = 64, side: int = 8, tuned: bool = False) -> dict:
    """One tile of side x side blocks (J2's shapes) by run_tile and by the synchronous executor
    on the same chunks, in the calling thread; `tuned`: the worker's malloc thresholds first."""
    from app.core.engine import elements_per_chunk
    from app.core.run import PassOne, SerialExecutor
    from app.core.job_tasks import JobSpec, Tile, run_tile
    from app.core.objectives import OBJECTIVES
    from app.jobs.tasks import restore_malloc_reuse

    if tuned:
        restore_malloc_reuse()
    torch.set_num_threads(1)
    objective = OBJECTIVES["sum_of_squares"]
    vectors = np.random.default_rng(0).standard_normal((n, dim)).astype(np.float32)
    spec = JobSpec(n, dim, factor, objective.name, 5.0, "float32", elements_per_chunk(16 << 20, objective, dim, 4))
    tile = Tile(0, range(side), range(side))

    def synchronous():
        one = PassOne(SerialExecutor(), torch.as_tensor(vectors), factor, spec.chunk_elements, objective, 5.0,
                     tile.rows, tile.cols)
        for _ in one:
            pass
        one.surely_finite()
    run_tile(vectors, spec, tile, objective)  # warm
    return {"run_tile": thread_cost(lambda: run_tile(vectors, spec, tile, objective)),
            "synchronous executor": thread_cost(synchronous),
            "MALLOC_TRIM_THRESHOLD_": os.environ.get("MALLOC_TRIM_THRESHOLD_")}


def tile_profile() -> list[Result]:
    """The same tile in this process and in a task of a one-worker LocalCluster with the nanny's
    defaults, untuned and as a tile task tunes it."""
    from distributed import Client, LocalCluster

    found = {"this process": tile_costs()}
    for tuned in (False, True):
        with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
                Client(cluster) as client:
            found[f"Dask worker, {'tuned' if tuned else 'untuned'}"] = \
                client.submit(tile_costs, tuned=tuned, pure=False).result()
    return [Result(f"TP. one tile of 8 x 8 blocks (N=8192 D=64 F=64 sum_of_squares): {where}", "-", "-", "-",
                   f"{costs}; {load()}") for where, costs in found.items()]


# J5 ---------------------------------------------------------------------------------------
def reset_peak_rss(pid: int) -> None:
    """VmHWM back to the current RSS (Linux's clear_refs), so that the next peak is this row's."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def stored_result(data_dir: str, n: int, dim: int) -> str:
    """A succeeded job with an (n, dim) float32 accumulated gradient, written into a new store
    as the runner writes one (db.finish_job); its id."""
    from app.jobs import db
    from app.jobs.settings import JobSettings

    engine = db.open_store(f"sqlite:///{data_dir}/jobs.sqlite3")
    job_id, now = "5" * 32, time.time()
    accumulated = np.random.default_rng(5).standard_normal((n, dim)).astype(np.float32)
    db.insert_job(engine, {"id": job_id, "n": n, "dim": dim, "factor": 64, "objective": "sum_of_squares",
                           "offset": 5.0, "dtype": "float32", "outputs": ["accumulated"], "blocks_total": 64 * 64,
                           "result_bytes": accumulated.nbytes, "idempotency_key": None, "created_at": now},
                  b"", JobSettings(max_jobs=1))
    attempt = db.claim(engine, job_id, "bench", now, 3600, 1)
    db.finish_job(engine, job_id, "bench", attempt, now, {"accumulated": accumulated}, None)
    engine.dispose()
    return job_id


def result_download(bench=None, n: int = 65536, dim: int = 64, clients: int = 6) -> list[Result]:
    """A stored result downloaded by `clients` at once from one web worker, as .npz and as JSON:
    that worker's peak RSS above its RSS before, against what the downloads reserved in its
    memory ledger (app/api/v1/jobs.stream_bytes each)."""
    from app.api.v1.jobs import stream_bytes

    result_bytes = n * dim * 4
    rows = []
    with tempfile.TemporaryDirectory() as data_dir:
        job_id = stored_result(data_dir, n, dim)
        with gunicorn_server(workers=1, env={"BLOCKGRAD_DATA_DIR": data_dir, "BLOCKGRAD_DASK_SCHEDULER": ""}) as server:
            [worker] = server.worker_pids()
            url = f"{server.url}/v1/jobs/{job_id}/result"
            for form, accept in (("npz", "application/x-npz"), ("JSON", "application/json")):
                requests.get(url, headers={"Accept": accept}, timeout=300).raise_for_status()  # warm
                before, sizes = rss_kib(worker), []
                reset_peak_rss(worker)
                all_started_together([lambda: sizes.append(len(requests.get(
                    url, headers={"Accept": accept}, timeout=600).content))] * clients)
                grown, body = (peak_rss_kib(worker) - before) * 1024, sizes[0]
                reserved = clients * stream_bytes("float32", form == "npz")
                rows.append(Result(f"J5. a stored result of N={n} D={dim} float32 ({result_bytes >> 20} MiB), {clients} "
                                   f"clients downloading it at once as {form}: the web worker's peak RSS growth / "
                                   "the downloads' reservations in its ledger", "<= 1x", f"{grown / reserved:.2f}x",
                                   at_most(grown / reserved, 1.0),
                                   f"grew {grown / 2**20:.1f} MiB from {before / 1024:.0f} MiB, reserved "
                                   f"{reserved / 2**20:.1f} MiB; bodies {body / 2**20:.1f} MiB each "
                                   f"({grown / body:.2f}x one); {load()}"))
    return rows


# J6 ---------------------------------------------------------------------------------------
def kept_jobs(bench=None, few: int = 30, many: int = 10_000, repeats: int = 15) -> list[Result]:
    """A POST, a GET of a job and a scrape on two servers alike but for their stores' history
    (`many` and `few` finished jobs kept, SQLite as `make serve` has it), alternated: the
    median ratio of their times per route."""
    env = {"BLOCKGRAD_DASK_SCHEDULER": "", "BLOCKGRAD_DASK_WORKERS": "1", "BLOCKGRAD_MAX_JOBS": "1000",
           "BLOCKGRAD_MAX_JOB_RECORDS": str(2 * many)}
    rows = []
    with tempfile.TemporaryDirectory() as small, tempfile.TemporaryDirectory() as large:
        ids = {dir_: add_finished_jobs(f"sqlite:///{dir_}/jobs.sqlite3", count)[0]
               for dir_, count in ((small, few), (large, many))}
        with gunicorn_server(workers=1, env={**env, "BLOCKGRAD_DATA_DIR": small}) as a, \
                gunicorn_server(workers=1, env={**env, "BLOCKGRAD_DATA_DIR": large}) as b:
            job = {a.url: ids[small], b.url: ids[large]}
            calls = {"POST /v1/jobs (a 16 x 4 job)": lambda url: requests.post(
                         url + "/v1/jobs", json={"vectors": np.ones((16, 4)).tolist(), "factor": 2}, timeout=60),
                     "GET /v1/jobs/{id}": lambda url: requests.get(f"{url}/v1/jobs/{job[url]}", timeout=60),
                     "GET /metrics": lambda url: requests.get(url + "/metrics", timeout=60)}
            for name, call in calls.items():
                for url in (a.url, b.url):
                    call(url).raise_for_status()  # warm: the store opened, statements prepared
                pair = paired(lambda: call(b.url).raise_for_status(), lambda: call(a.url).raise_for_status(),
                              repeats=repeats)
                rows.append(Result(f"J6. {name}: time with {many} finished jobs kept / with {few}", "<= 1.25x",
                                   f"{pair.ratio:.2f}x", at_most(pair.ratio, 1.25),
                                   f"{pair.a_s * 1e3:.1f} ms vs {pair.b_s * 1e3:.1f} ms (medians); {load()}"))
    return rows


# J7 ---------------------------------------------------------------------------------------
def runner_peak(bench=None, factor: int = 5792) -> list[Result]:
    """A job whose result is as large as BLOCKGRAD_MAX_JOB_RESULT_BYTES allows (F x F float64
    losses, N = F, D = 1): the runner's peak RSS above its RSS before, against the result's
    size (docs/operations.md, "Memory budget": the runner holds one result at a time)."""
    import psutil

    result_bytes = factor * factor * 8
    with job_server(2) as server:
        runner = next(p for p in psutil.Process(server.pid).children(recursive=True)
                      if " -m app.jobs.runner" in " ".join(p.cmdline()))
        before = rss_kib(runner.pid) * 1024
        reset_peak_rss(runner.pid)
        body = {"vectors": random_vectors(factor, 1).tolist(), "factor": factor, "dtype": "float64",
                "outputs": ["losses"]}
        job = requests.post(server.url + "/v1/jobs", json=body, timeout=60)
        job.raise_for_status()
        record = wait_for(server.url, job.json()["id"], JOB_LIMIT_S, 0.5)
        grown = peak_rss_kib(runner.pid) * 1024 - before
    return [Result(f"J7. a job's result of {result_bytes >> 20} MiB (F={factor} losses, float64) stored: the runner's "
                   "peak RSS growth / the result's size", "<= 1.5x", f"{grown / result_bytes:.2f}x",
                   at_most(grown / result_bytes, 1.5),
                   f"{record['status']}; grew {grown / 2**20:.0f} MiB from {before / 2**20:.0f} MiB; {load()}")]


# J8 ---------------------------------------------------------------------------------------
# distributed's own defaults for what IDLE_CONFIG sets (its distributed.yaml)
DISTRIBUTED_DEFAULTS = {"DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED": "True",
                        "DASK_DISTRIBUTED__ADMIN__TICK__INTERVAL": "20ms",
                        "DASK_DISTRIBUTED__ADMIN__SYSTEM_MONITOR__INTERVAL": "500ms"}


def idle_cluster_cpu(bench=None, window_s: float = 30.0) -> list[Result]:
    """Two servers with embedded clusters of 2 workers, idle over the same window: the CPU of
    every process below each master (cluster, runner, gunicorn's workers), IDLE_CONFIG's
    against distributed's defaults (docs/jobs.md, "Idle")."""
    from app.jobs.cluster import IDLE_CONFIG

    assert DISTRIBUTED_DEFAULTS.keys() == IDLE_CONFIG.keys()
    with job_server(2) as quiet, job_server(2, **DISTRIBUTED_DEFAULTS) as defaults:
        def ticks() -> list[int]:
            return [sum(cpu_ticks(pid) for pid in descendants(s.pid) if Path(f"/proc/{pid}").exists())
                    for s in (quiet, defaults)]
        time.sleep(5.0)  # the first job's and the joins' work over
        before = ticks()
        time.sleep(window_s)
        after = ticks()
    share = [(b - a) / os.sysconf("SC_CLK_TCK") / window_s for a, b in zip(before, after)]
    ratio = share[0] / share[1]
    return [Result("J8. an idle service with its embedded cluster (2 workers): CPU with IDLE_CONFIG / with "
                   "distributed's defaults", "<= 0.5x", f"{ratio:.2f}x", at_most(ratio, 0.5),
                   f"{100 * share[0]:.1f}% vs {100 * share[1]:.1f}% of a core over the same {window_s:g} s; {load()}")]


ROWS = {"J1": job_overhead, "J2": job_scaling, "J3": lambda: job_size(named=True), "J4": job_model,
        "J5": result_download, "J6": kept_jobs, "J7": runner_peak, "J8": idle_cluster_cpu}
NAMED_ONLY = {"TP": tile_profile}


def main(argv: list[str]) -> int:
    for key in argv or list(ROWS):
        for result in {**ROWS, **NAMED_ONLY}[key]():
            print(" | ".join((result.name, result.target, result.measured, result.verdict, result.detail)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
