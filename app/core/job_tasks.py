"""A job's computation cut into tasks of whole block tiles, and their reduction.

A tile is a range of block rows x a range of block columns. Its task computes every
block of the tile with the engine's own functions (`chunk_gradients`, `chain_rule_sums`)
a chunk at a time, so a task's memory is bounded by a chunk plus its partial sums, and
returns the tile's losses and its share of the accumulated gradient: rows x D onto the
tile's rows of V and cols x D onto its columns, (rows + cols) x D in all, never N x D.
Partials are then summed in a tree of reductions into the job's (N, D) accumulated
gradient and (F, F) losses.

Numbers: each block's loss and gradient are the engine's (losses bit for bit with one
torch thread, as /v1 computes them); the accumulated gradient differs from /v1's only in
the order of the additions.

Pure module: numpy arrays and ints in, numpy arrays out. Nothing here knows where it
runs (app/jobs/ ships these functions to Dask workers).
"""
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .dtypes import TORCH_DTYPES
from .engine import Chunk, block_bounds, chain_rule_sums, chunk_gradients, shape_groups, split
from .errors import non_finite_accumulated, non_finite_block
from .objectives import OBJECTIVES

# Numbers (pairs x 2D) one tile task computes: large against a task's scheduling overhead,
# small enough that a cancelled job frees its worker soon (docs/jobs.md).
TILE_NUMBERS = 256 * 1024 * 1024
TILES_PER_WORKER = 4  # at least this many tiles per worker when the blocks allow it
REDUCE_FAN_IN = 8  # partials summed by one reduction task


@dataclass(frozen=True)
class JobSpec:
    """What every task of one job needs besides the vectors."""
    n: int
    dim: int
    factor: int
    objective: str  # a built-in objective's name
    offset: float
    dtype: str
    chunk_elements: int  # numbers per chunk (engine.elements_per_chunk)


@dataclass(frozen=True)
class Tile:
    index: int
    rows: range  # block row indices
    cols: range  # block column indices

    @property
    def blocks(self) -> int:
        return len(self.rows) * len(self.cols)


@dataclass
class TilePartial:
    """A tile's losses and its (rows + cols) x D share of dL/dV."""
    rows: range
    cols: range
    row_start: int  # first row of V the tile's rows cover
    col_start: int
    losses: np.ndarray  # (len(rows), len(cols))
    row_sums: np.ndarray  # (tile rows of V, D)
    col_sums: np.ndarray  # (tile columns of V, D)
    started_at: float  # time.time() when the task began
    bad_block: tuple[int, int] | None  # the tile's first block that is not finite, row-major

    @property
    def nbytes(self) -> int:
        return self.losses.nbytes + self.row_sums.nbytes + self.col_sums.nbytes


@dataclass
class JobSum:
    """The sum of some partials: dense (N, D) and (F, F)."""
    accumulated: np.ndarray  # (N, D)
    losses: np.ndarray  # (F, F)
    filled: np.ndarray  # (F, F) bool: which losses a tile has set
    started_at: float
    bad_block: tuple[int, int] | None
    bytes_moved: int  # bytes of the partials and sums this one was made from


@dataclass
class JobOutcome:
    accumulated: np.ndarray | None  # (N, D), None when failed
    losses: np.ndarray | None  # (F, F)
    error: dict | None  # {"code", "message", "details"} when failed
    started_at: float
    finished_at: float
    bytes_moved: int
    summary: dict = field(default_factory=dict)


def plan_tiles(n: int, dim: int, factor: int, workers: int = 1, tile_numbers: int = TILE_NUMBERS) -> list[Tile]:
    """Square tiles of whole blocks, row-major, each about tile_numbers numbers (at least one
    block), and at least TILES_PER_WORKER per worker while blocks allow it."""
    base = max(1, n // factor)
    per_block = base * base * 2 * dim
    side = max(1, math.isqrt(max(1, tile_numbers // per_block)))
    wanted = TILES_PER_WORKER * max(1, workers)
    side = max(1, min(side, math.ceil(factor / math.ceil(math.sqrt(wanted)))))
    tiles = []
    for r0 in range(0, factor, side):
        for c0 in range(0, factor, side):
            tiles.append(Tile(len(tiles), range(r0, min(factor, r0 + side)), range(c0, min(factor, c0 + side))))
    return tiles


def overlap(a: range, b: range) -> range:
    return range(max(a.start, b.start), min(a.stop, b.stop))


def tile_chunks(n: int, dim: int, factor: int, tile: Tile, max_elements: int) -> list[Chunk]:
    """The engine's chunks (blocks of one shape, at most max_elements numbers, at least one
    block) covering exactly the tile's blocks."""
    base, pair = n // factor, 2 * dim
    chunks = []
    for row_group, height in shape_groups(n, factor):
        rows = overlap(row_group, tile.rows)
        for col_group, width in shape_groups(n, factor):
            cols = overlap(col_group, tile.cols)
            if not rows or not cols:
                continue
            per_chunk = max(1, max_elements // (height * width * pair))  # blocks in one chunk
            if len(cols) <= per_chunk:
                for run in split(rows, max(1, per_chunk // len(cols))):
                    chunks.append(Chunk(run, cols, height, width, base))
            else:
                for r in rows:
                    chunks.extend(Chunk(range(r, r + 1), run, height, width, base) for run in split(cols, per_chunk))
    return chunks


def first_bad_block(vectors: torch.Tensor, chunks: list[Chunk], spec: JobSpec) -> tuple[int, int] | None:
    """Row-major, the first block of these chunks whose loss or gradient is not finite."""
    objective = OBJECTIVES[spec.objective]
    found = []
    for chunk in chunks:
        result = chunk_gradients(vectors, chunk, objective, spec.offset)
        finite = torch.isfinite(result.losses) & torch.isfinite(result.gradient).flatten(2).all(dim=2)
        found += [(chunk.rows[i], chunk.cols[j]) for i, j in torch.nonzero(~finite).tolist()]
    return min(found, default=None)


def run_tile(vectors: np.ndarray, spec: JobSpec, tile: Tile) -> TilePartial:
    """Every block of the tile: its losses and its chain-rule sums onto V's rows and columns."""
    started_at = time.time()
    torch.set_num_threads(1)  # one core per task, and the same loss bits as /v1's one thread
    v = torch.as_tensor(vectors, dtype=TORCH_DTYPES[spec.dtype])  # (N, D)
    bounds = block_bounds(spec.n, spec.factor)
    row_start, col_start = bounds[tile.rows.start], bounds[tile.cols.start]
    row_sums = torch.zeros((bounds[tile.rows.stop] - row_start, spec.dim), dtype=v.dtype)  # (rows, D)
    col_sums = torch.zeros((bounds[tile.cols.stop] - col_start, spec.dim), dtype=v.dtype)  # (cols, D)
    losses = torch.empty((len(tile.rows), len(tile.cols)), dtype=v.dtype)
    objective = OBJECTIVES[spec.objective]
    chunks = tile_chunks(spec.n, spec.dim, spec.factor, tile, spec.chunk_elements)
    # A sum is finite only if all its terms are: one check per chunk, no pass over gradients.
    finite = torch.ones((), dtype=torch.bool)
    for chunk in chunks:
        result = chunk_gradients(v, chunk, objective, spec.offset)
        sums = chain_rule_sums(result)  # (kr * h, D), (kc * w, D)
        r0, c0 = chunk.rows.start * chunk.base - row_start, chunk.cols.start * chunk.base - col_start
        row_sums[r0:r0 + sums.rows.shape[0]] += sums.rows
        col_sums[c0:c0 + sums.cols.shape[0]] += sums.cols
        losses[chunk.rows.start - tile.rows.start:chunk.rows.stop - tile.rows.start,
               chunk.cols.start - tile.cols.start:chunk.cols.stop - tile.cols.start] = result.losses
        finite &= torch.isfinite(result.losses.sum() + sums.rows.sum() + sums.cols.sum())
    bad = None if bool(finite) else first_bad_block(v, chunks, spec)
    return TilePartial(tile.rows, tile.cols, row_start, col_start, losses.numpy(), row_sums.numpy(),
                       col_sums.numpy(), started_at, bad)


def reduce_parts(spec: JobSpec, *parts: "TilePartial | JobSum") -> JobSum:
    """Partials and sums added into one dense sum (order: as given)."""
    dtype = np.dtype(spec.dtype)
    accumulated = np.zeros((spec.n, spec.dim), dtype=dtype)
    losses = np.zeros((spec.factor, spec.factor), dtype=dtype)
    filled = np.zeros((spec.factor, spec.factor), dtype=bool)
    bad, started, moved = [], [], 0
    for part in parts:
        started.append(part.started_at)
        if part.bad_block is not None:
            bad.append(tuple(part.bad_block))
        if isinstance(part, JobSum):
            accumulated += part.accumulated
            np.copyto(losses, part.losses, where=part.filled)  # copied, not added: a -0.0 stays -0.0
            filled |= part.filled
            moved += part.bytes_moved + part.accumulated.nbytes + part.losses.nbytes
            continue
        accumulated[part.row_start:part.row_start + part.row_sums.shape[0]] += part.row_sums
        accumulated[part.col_start:part.col_start + part.col_sums.shape[0]] += part.col_sums
        losses[part.rows.start:part.rows.stop, part.cols.start:part.cols.stop] = part.losses
        filled[part.rows.start:part.rows.stop, part.cols.start:part.cols.stop] = True
        moved += part.nbytes
    return JobSum(accumulated, losses, filled, min(started), min(bad, default=None), moved)


def reduction_levels(count: int, fan_in: int = REDUCE_FAN_IN) -> list[list[range]]:
    """The tree: at each level, which consecutive items of the level below each task sums."""
    levels = []
    while count > 1 or not levels:
        groups = [range(k, min(count, k + fan_in)) for k in range(0, count, fan_in)]
        levels.append(groups)
        count = len(groups)
    return levels


def finish(spec: JobSpec, total: JobSum) -> JobOutcome:
    """The job's answer, or the error /v1 would give for the same body."""
    now = time.time()
    error = None
    if total.bad_block is not None:
        error = non_finite_block(*total.bad_block, spec.dtype)
    elif not np.isfinite(total.accumulated).all():
        error = non_finite_accumulated(spec.dtype)
    if error is not None:
        return JobOutcome(None, None, {"code": error.code, "message": error.message, "details": error.details},
                          total.started_at, now, total.bytes_moved)
    return JobOutcome(total.accumulated, total.losses, None, total.started_at, now, total.bytes_moved)
