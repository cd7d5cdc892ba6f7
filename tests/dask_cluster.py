"""Helpers of the job tests: waiting for a local Dask cluster's workers (the `cluster` fixture
in conftest.py, and tests that start a cluster of their own) and for a job, a .npy body, and
`tile_faults`, the page faults of one tile computed as a Dask worker computes it."""
import dataclasses
import io

import numpy as np

from app.jobs.client import cluster_client
from app.jobs.on_scheduler import workers_count
from tools.server import wait_until

CLUSTER_START_S = 90  # bounded: two workers importing torch on a loaded 2-core machine
JOB_S = 90  # a small job's bound, far above its time


def wait_for_workers(address: str, count: int, timeout_s: float = CLUSTER_START_S) -> None:
    def ready():
        try:
            return cluster_client(address).run_on_scheduler(workers_count) >= count
        except Exception:  # noqa: BLE001 - not up yet
            return False
    assert wait_until(ready, timeout_s, 0.5), f"{count} Dask workers did not join within {timeout_s} s"


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
