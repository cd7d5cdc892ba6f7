"""Helpers of the job tests: this process's own Dask Client (app/ has only the runner's), waiting
for a local Dask cluster's workers (the `cluster` fixture in conftest.py, and tests that start
a cluster of their own) and for a job, a job runner thread on a store (`running`, `threaded`), a .npy
body, and `tile_faults`, the page faults of one tile computed as a Dask worker computes it."""
import contextlib
import dataclasses
import io
import secrets
import time

import numpy as np

from tools.server import wait_until

CLUSTER_START_S = 90  # bounded: two workers importing torch on a loaded 2-core machine
JOB_S = 90  # a small job's bound, far above its time
_clients: dict = {}


def cluster_tls_env(address: str) -> dict[str, str]:
    """The TLS credentials of the embedded cluster at `address` (tls://127.0.0.1:PORT), as Dask
    configuration variables: those its supervisor (`-m app.jobs.supervisor PORT ...`, a process
    of this user) has in its environment; {} for another address."""
    import psutil

    port = address.rsplit(":", 1)[-1]
    for process in psutil.process_iter(["cmdline"]):
        if (process.info["cmdline"] or [])[1:4] == ["-m", "app.jobs.supervisor", port]:
            return {name: value for name, value in process.environ().items()
                    if name.startswith("DASK_DISTRIBUTED__COMM__")}
    return {}


def cluster_config(address: str) -> dict:
    """The credentials of cluster_tls_env as dask.config.set takes them (dotted keys): a Client of
    a tls:// address then uses them; a tcp:// one is not refused (no require-encryption)."""
    import dask.config
    import distributed  # noqa: F401 - its defaults in Dask's config now: dask.config.set's exit
    # deletes every key that did not exist when it began, the whole "distributed" tree included

    def flat(tree: dict, prefix: str = ""):
        for key, value in tree.items():
            yield from flat(value, f"{prefix}{key}.") if isinstance(value, dict) else [(prefix + key, value)]
    env = {name: value for name, value in cluster_tls_env(address).items() if "__TLS__" in name}
    return dict(flat(dask.config.collect_env(env)))


def cluster_client(address: str):
    """This test process's Client of `address` (with the cluster's credentials), made on first
    use (again once closed)."""
    import dask.config
    from distributed import Client

    client = _clients.get(address)
    if client is None or client.status not in ("running", "connecting"):
        with dask.config.set(cluster_config(address)):  # the Client keeps the Security it makes now
            client = _clients[address] = Client(address, timeout=30, set_as_default=False)
    return client


def close_clients(address: str | None = None) -> None:
    for known in [a for a in _clients if address in (None, a)]:
        _clients.pop(known).close(timeout=10)


def wait_for_workers(address: str, count: int, timeout_s: float = CLUSTER_START_S) -> None:
    def ready():
        try:
            return len(cluster_client(address).nthreads()) >= count
        except Exception:  # noqa: BLE001 - not up yet
            return False
    assert wait_until(ready, timeout_s, 0.5), f"{count} Dask workers did not join within {timeout_s} s"


def store_config(directory, **settings) -> dict:
    """The BLOCKGRAD_* values of a job store in `directory` (SQLite) with short leases, over `settings`."""
    return {"BLOCKGRAD_DATA_DIR": str(directory / "data"), "BLOCKGRAD_JOB_LEASE_S": "2", **settings}


@contextlib.contextmanager
def running(address: str, config: dict, objectives=None):
    """A job runner thread (app/jobs/runner.py) of the cluster at `address`, on the store that
    `config` (BLOCKGRAD_* values over the environment, as create_app takes them) names; stopped
    (its jobs released) on exit. `objectives`: an app's (services_of(app).objectives), else the built-ins."""
    from app.core.objectives import OBJECTIVES
    from app.core.settings import environment
    from app.jobs import db
    from app.jobs.runner import Runner
    from app.jobs.settings import JobSettings

    settings = JobSettings.from_env(environment(config))
    runner = threaded(Runner(settings, OBJECTIVES if objectives is None else objectives,
                             db.open_store(settings.database_url()), address))
    try:
        yield runner
    finally:
        runner.stop()


def threaded(runner):
    """`runner` (app/jobs/runner.py's Runner) run on a thread of this process, as `python -m
    app.jobs.runner` runs it; `runner.stop()`, made here, stops it as SIGTERM does (its jobs
    handed back) and waits for the thread."""
    import threading

    stopping = threading.Event()
    thread = threading.Thread(target=runner.run, args=(stopping,), name="blockgrad-runner", daemon=True)

    def stop():
        stopping.set()
        runner.wake.set()
        thread.join(60)
    runner.stop = stop
    thread.start()
    return runner


def insert_job(engine, vectors: np.ndarray, factor: int, objective: str = "sum", offset: float = 5.0,
               outputs=("accumulated", "losses")) -> str:
    """A job written into the store as POST /v1/jobs writes it (queued, with its input): its id."""
    from app.jobs import db
    from app.jobs.settings import JobSettings

    job_id = secrets.token_hex(16)
    row = {"id": job_id, "n": len(vectors), "dim": vectors.shape[1], "factor": factor, "objective": objective,
           "offset": offset, "dtype": str(vectors.dtype), "outputs": list(outputs), "blocks_total": factor ** 2,
           "result_bytes": vectors.nbytes + factor ** 2 * vectors.itemsize, "idempotency_key": None,
           "created_at": time.time()}
    db.insert_job(engine, row, npy(vectors), JobSettings(max_jobs=64))
    return job_id


def wait_for_stored(engine, job_id: str, timeout_s: float = JOB_S) -> dict:
    """The job's row in the store once it has finished."""
    from app.jobs import db

    rows = []
    assert wait_until(lambda: rows.append(db.get_job(engine, job_id)) or rows[-1]["status"] not in (
        "queued", "running"), timeout_s, 0.1), rows[-1]
    return rows[-1]


def stored_result(engine, record: dict, output: str) -> np.ndarray:
    from app.jobs import db

    return np.concatenate(list(db.result_chunks(engine, record, output)))


def wait_for_job(client, job_id: str, timeout_s: float = JOB_S) -> dict:
    """The job's record once it has finished (a Flask test client's GET /v1/jobs/<id>)."""
    records = []

    def finished():
        records.append(client.get(f"/v1/jobs/{job_id}").get_json())
        return records[-1]["status"] not in ("queued", "running")
    assert wait_until(finished, timeout_s, 0.2), records[-1]
    return records[-1]


def npy(array: np.ndarray, **kwargs) -> bytes:
    """`array` as a .npy body."""
    buffer = io.BytesIO()
    np.save(buffer, array, **kwargs)
    return buffer.getvalue()


TILE_N, TILE_DIM, TILE_FACTOR, TILE_BLOCKS = 2048, 64, 16, 4 * 4  # 128 x 128 blocks: 8 MiB of pairs each, as J2's
TILE = ((0, 4), (0, 4))  # the tile's block rows and columns


def tile_job() -> tuple[np.ndarray, dict]:
    """The vectors and task spec of the job whose TILE `tile_faults` computes."""
    from app.core.engine import elements_per_chunk
    from app.core.job_tasks import JobSpec
    from app.core.objectives import OBJECTIVES

    vectors = np.random.default_rng(5).standard_normal((TILE_N, TILE_DIM)).astype(np.float32)
    chunk = elements_per_chunk(16 * 1024 * 1024, OBJECTIVES["sum_of_squares"], TILE_DIM, vectors.itemsize)
    spec = JobSpec(TILE_N, TILE_DIM, TILE_FACTOR, "sum_of_squares", 5.0, "float32", chunk)
    return vectors, dataclasses.asdict(spec)


def tile_faults(vectors, spec: dict, rows: tuple[int, int], cols: tuple[int, int]) -> int:
    """Minor page faults of this thread while it computes one job tile as a worker does
    (app/jobs/tasks.py tile_task): pages the kernel had to map, and zero, for it."""
    import resource

    from app.jobs.tasks import tile_task

    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    tile_task(vectors, spec, rows, cols)
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


HOLD_S = 600  # a held tile's own bound: past it the tile computes, so no worker is held for ever


class HeldTiles:
    """Job tiles held at their start, on a local cluster's workers, until released: a fault is
    then made at a known point instead of raced. Installed with Client.run in each worker
    process present (app/jobs/tasks.py's tile_task, which the graph names by reference, is
    wrapped there; nothing in app/ knows of it). Each tile that starts writes a file into
    `directory` named by its worker's pid and its key, then waits for `directory`/release (all
    tiles) or for its own release file (release_tile). A worker started later (a restarted
    one) runs its tiles unheld."""

    def __init__(self, address: str, directory):
        from pathlib import Path

        self.address, self.directory = address, Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def __enter__(self) -> "HeldTiles":
        cluster_client(self.address).run(hold_tiles, str(self.directory))
        return self

    def __exit__(self, *exc):
        self.release()
        try:
            cluster_client(self.address).run(unhold_tiles)
        except Exception:  # noqa: BLE001 - a cluster already stopped holds nothing
            pass

    def release(self) -> None:
        (self.directory / "release").touch()

    def release_tile(self, key: str) -> None:
        """Only the held tile `key` (as started() names it) goes on."""
        for path in self.directory.glob("started-*"):
            if path.read_text().split(" ", 1)[1] == key:
                (self.directory / path.name.replace("started-", "release-", 1)).touch()

    def started(self, job_id: str) -> list[tuple[int, str]]:
        """(worker pid, key) of each start of one of the job's tiles, in no particular order."""
        found = []
        for path in self.directory.glob("started-*"):
            pid, key = path.read_text().split(" ", 1)
            if job_id in key:
                found.append((int(pid), key))
        return found

    def wait_started(self, job_id: str, count: int = 1, timeout_s: float = JOB_S) -> list[tuple[int, str]]:
        assert wait_until(lambda: len(self.started(job_id)) >= count, timeout_s, 0.05), \
            f"{count} tiles of job {job_id} did not start within {timeout_s} s: {self.started(job_id)}"
        return self.started(job_id)


def hold_tiles(directory: str) -> None:
    """On a worker (Client.run): wrap tile_task as HeldTiles says."""
    import os
    import time
    import uuid
    from pathlib import Path

    from distributed import get_worker

    from app.jobs import tasks

    original = getattr(tasks.tile_task, "unheld", tasks.tile_task)

    def held(*args, **kwargs):
        key = get_worker().get_current_task()
        name = uuid.uuid4().hex
        Path(directory, f".{name}").write_text(f"{os.getpid()} {key}")
        os.replace(Path(directory, f".{name}"), Path(directory, f"started-{name}"))  # read whole or not at all
        deadline = time.monotonic() + HOLD_S
        released = (Path(directory, "release"), Path(directory, f"release-{name}"))
        while not any(path.exists() for path in released) and time.monotonic() < deadline:
            time.sleep(0.02)
        return original(*args, **kwargs)
    held.unheld = original
    tasks.tile_task = held


def unhold_tiles() -> None:
    from app.jobs import tasks

    tasks.tile_task = getattr(tasks.tile_task, "unheld", tasks.tile_task)


def task_runs(job_id: str, dask_scheduler=None) -> dict[str, list[str]]:
    """On the scheduler (Client.run_on_scheduler): each of the job's keys -> the states it
    entered, in order, from the scheduler's transition log."""
    runs: dict[str, list[str]] = {}
    for transition in dask_scheduler.transition_log:
        if job_id in str(transition.key):
            runs.setdefault(str(transition.key), []).append(transition.finish)
    return runs


def has_task(key: str, dask_scheduler=None) -> bool:
    """On the scheduler (Client.run_on_scheduler): whether it knows the task `key`."""
    return key in dask_scheduler.tasks


def dask_role(cmdline: str) -> str | None:
    """"scheduler" or "worker" for a `python -m dask <role> ...` process, whether its command
    line is as started or as distributed retitles it ("dask <role> [address]") when
    setproctitle is installed; None for any other process."""
    for role in ("scheduler", "worker"):
        if f" -m dask {role} " in cmdline or cmdline.startswith(f"dask {role} ["):
            return role
    return None


def input_copies(key: str, dask_scheduler=None) -> dict[str, int]:
    """On the scheduler: each input of task `key` -> how many workers hold it."""
    return {str(dep.key): len(dep.who_has or ()) for dep in dask_scheduler.tasks[key].dependencies}
