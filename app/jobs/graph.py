"""A job as a task graph on the cluster: the vectors scattered once to every worker (and a
model's program, by content, once per worker: programs.py), one task per block tile
(app/core/job_tasks.py), a tree of sums per band of rows, the outcome, whose task writes
the job's end into the scheduler's metadata (tasks.py)."""
from dataclasses import asdict, replace

import numpy as np

from ..core.job_tasks import FINISH_FAN_IN, JobSpec, Tile, band_groups, reduction_levels
from ..core.objectives import Objective
from .client import call
from .on_scheduler import finish_key, outcome_key, tile_key
from .programs import shipped_program
from .tasks import band_task, finish_task, outcome_task, tile_task

SCATTER_BYTES_PER_S = 50e6  # the scatter's time bound grows with the vectors


def dataset_name(job_id: str) -> str:
    return f"blockgrad-job-{job_id}"


def submit(client, job_id: str, vectors: np.ndarray, spec: JobSpec, tiles: list[Tile],
           objective: Objective | None = None) -> None:
    """Scatter, submit every task, and publish the final ones under the job's name: the
    scheduler then holds the graph whatever becomes of this process. `objective`: the
    request's, whose program is shipped when it is a model."""
    timeout = 3.0 + vectors.nbytes / SCATTER_BYTES_PER_S
    shipped, program = shipped_program(client, objective, timeout) or (None, None)
    if shipped is not None:
        spec = replace(spec, program=shipped)
    plain = asdict(spec)
    [scattered] = call(client, client._scatter, [vectors], broadcast=True, hash=False, timeout_s=timeout)
    parts = [client.submit(tile_task, scattered, plain, (tile.rows.start, tile.rows.stop),
                           (tile.cols.start, tile.cols.stop), program, key=tile_key(job_id, tile.index), pure=False)
             for tile in tiles]
    finals = parts if len(parts) <= FINISH_FAN_IN else band_sums(client, job_id, tiles, parts)
    done = client.submit(finish_task, plain, *finals, key=finish_key(job_id), pure=False)
    outcome = client.submit(outcome_task, job_id, plain, done, key=outcome_key(job_id), pure=False)
    call(client, client._publish_dataset, [done, outcome], name=dataset_name(job_id), timeout_s=timeout)


def band_sums(client, job_id: str, tiles: list[Tile], parts: list) -> list:
    """A tree of sums per tile row (their row shares and losses) and per tile column."""
    bands = []
    for kind, groups in band_groups(tiles).items():
        for g, members in enumerate(groups):
            level = [parts[k] for k in members]
            for depth, sums in enumerate(reduction_levels(len(level))):
                level = [client.submit(band_task, kind, *(level[i] for i in group),
                                       key=f"blockgrad-sum-{job_id}-{kind}{g}-{depth}-{k}", pure=False)
                         for k, group in enumerate(sums)]
            bands.append(level[0])
    return bands
