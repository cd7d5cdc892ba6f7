"""Waiting for a local Dask cluster's workers (the `cluster` fixture in conftest.py, and
tests that start a cluster of their own)."""
from app.jobs.client import cluster_client
from app.jobs.on_scheduler import workers_count
from tools.server import wait_until

CLUSTER_START_S = 90  # bounded: two workers importing torch on a loaded 2-core machine


def wait_for_workers(address: str, count: int, timeout_s: float = CLUSTER_START_S) -> None:
    def ready():
        try:
            return cluster_client(address).run_on_scheduler(workers_count) >= count
        except Exception:  # noqa: BLE001 - not up yet
            return False
    assert wait_until(ready, timeout_s, 0.5), f"{count} Dask workers did not join within {timeout_s} s"


def tile_faults(vectors, spec: dict, rows: tuple[int, int], cols: tuple[int, int]) -> int:
    """Minor page faults of this thread while it computes one job tile as a worker does
    (app/jobs/tasks.py tile_task): pages the kernel had to map, and zero, for it."""
    import resource

    from app.jobs.tasks import tile_task

    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    tile_task(vectors, spec, rows, cols)
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
