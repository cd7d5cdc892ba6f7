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
