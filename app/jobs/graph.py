"""A job as a task graph on the cluster: the vectors scattered once to every worker, one
task per block tile (app/core/job_tasks.py), a tree of sums, the outcome, whose task
writes the job's end into the scheduler's metadata (tasks.py)."""
from dataclasses import asdict

import numpy as np

from ..core.job_tasks import JobSpec, Tile, plan_tiles, reduction_levels
from .client import call
from .on_scheduler import finish_key, outcome_key, tile_key
from .tasks import finish_task, outcome_task, sum_task, tile_task

SCATTER_BYTES_PER_S = 50e6  # the scatter's time bound grows with the vectors


def dataset_name(job_id: str) -> str:
    return f"blockgrad-job-{job_id}"


def plan(spec: JobSpec, workers: int) -> list[Tile]:
    return plan_tiles(spec.n, spec.dim, spec.factor, workers)


def submit(client, job_id: str, vectors: np.ndarray, spec: JobSpec, tiles: list[Tile]) -> None:
    """Scatter, submit every task, and publish the final ones under the job's name: the
    scheduler then holds the graph whatever becomes of this process."""
    timeout = 3.0 + vectors.nbytes / SCATTER_BYTES_PER_S
    plain = asdict(spec)
    [scattered] = call(client, client._scatter, [vectors], broadcast=True, hash=False, timeout_s=timeout)
    level = [client.submit(tile_task, scattered, plain, (tile.rows.start, tile.rows.stop),
                           (tile.cols.start, tile.cols.stop), key=tile_key(job_id, tile.index), pure=False)
             for tile in tiles]
    for depth, groups in enumerate(reduction_levels(len(level))):
        level = [client.submit(sum_task, plain, *(level[i] for i in group),
                               key=f"blockgrad-sum-{job_id}-{depth}-{k}", pure=False)
                 for k, group in enumerate(groups)]
    done = client.submit(finish_task, plain, level[0], key=finish_key(job_id), pure=False)
    outcome = client.submit(outcome_task, job_id, plain, done, key=outcome_key(job_id), pure=False)
    call(client, client._publish_dataset, [done, outcome], name=dataset_name(job_id), timeout_s=timeout)
