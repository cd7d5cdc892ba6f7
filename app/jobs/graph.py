"""A job's attempt as a task graph on the cluster, through Dask's public API: the vectors
scattered once to every worker (and a model's program, by content, once per worker:
programs.py), one task per block tile (app/core/job_tasks.py), a tree of sums per band of
rows, and the final task whose outcome the runner gathers. Keys carry the job's id and the
attempt's number, so a resubmitted graph never meets the keys of a lost one."""
from dataclasses import asdict, dataclass, replace

import numpy as np

from ..core.job_tasks import FINISH_FAN_IN, JobSpec, Tile, band_groups, reduction_levels
from ..core.objectives import Objective
from .programs import shipped_program
from .tasks import band_task, finish_task, tile_task


@dataclass
class Graph:
    final: object  # the outcome's future
    tiles: dict  # key -> (future, blocks) of the tiles not finished yet
    held: list  # the scattered inputs: while held, Dask computes again what a lost worker held


def submit(client, name: str, vectors: np.ndarray, spec: JobSpec, tiles: list[Tile], objective: Objective,
           timeout_s: float) -> Graph:
    """`name`: the job's id and attempt; `objective`: the request's, whose program is shipped
    when it is a model."""
    shipped, program = shipped_program(client, objective, timeout_s) or (None, None)
    if shipped is not None:
        spec = replace(spec, program=shipped)
    plain = asdict(spec)
    [scattered] = client.scatter([vectors], broadcast=True, hash=False, timeout=timeout_s)
    parts = [client.submit(tile_task, scattered, plain, (tile.rows.start, tile.rows.stop),
                           (tile.cols.start, tile.cols.stop), program, key=f"blockgrad-tile-{name}-{tile.index}",
                           pure=False) for tile in tiles]
    finals = parts if len(parts) <= FINISH_FAN_IN else band_sums(client, name, tiles, parts, spec.traceparent)
    final = client.submit(finish_task, plain, *finals, key=f"blockgrad-finish-{name}", pure=False)
    return Graph(final, {part.key: (part, tile.blocks) for part, tile in zip(parts, tiles)}, [scattered, program])


def band_sums(client, name: str, tiles: list[Tile], parts: list, traceparent: str | None) -> list:
    """A tree of sums per tile row (their row shares and losses) and per tile column."""
    bands = []
    for kind, groups in band_groups(tiles).items():
        for g, members in enumerate(groups):
            level = [parts[k] for k in members]
            for depth, sums in enumerate(reduction_levels(len(level))):
                level = [client.submit(band_task, traceparent, kind, *(level[i] for i in group),
                                       key=f"blockgrad-sum-{name}-{kind}{g}-{depth}-{k}", pure=False)
                         for k, group in enumerate(sums)]
            bands.append(level[0])
    return bands
