"""A job's computation cut into tasks of whole block tiles, and their reduction.

A tile is a range of block rows x a range of block columns. Its task runs /v1's pass one
(`run.PassOne`: the engine's one plan, restricted to the tile, and the finiteness
proof), so a task's memory is bounded by a chunk plus its partial sums, and returns the
tile's losses and its share of the accumulated gradient: rows x D onto the tile's rows of
V and cols x D onto its columns, (rows + cols) x D in all, never N x D.

Only the outputs the job asked for move and are assembled: one not asked for is an empty
(0, 0) array from the tile on (the same code adds and places nothing), so a job without
`losses` never holds F x F numbers, nor one without `accumulated` N x D.

The reduction never makes a dense N x D sum until the last task: the row shares of the
tiles of one tile row all land on the same rows of V, so they are summed on their own
(a band of rows x D), and likewise the column shares of one tile column. The last task
adds the bands into the job's (N, D) accumulated gradient and places the tiles' losses.

Numbers: each block's loss and gradient are the engine's (losses bit for bit with one
torch thread, as /v1 computes them); the accumulated gradient differs from /v1's only in
the order of the additions.

Pure module: numpy arrays, ints and an Objective in, numpy arrays out. Nothing here knows
where it runs (app/jobs/ ships these functions to Dask workers).
"""
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .dtypes import DTYPES
from .engine import block_bounds
from .errors import non_finite_accumulated, non_finite_block
from .objectives import Objective
from .run import PassOne, SerialExecutor

# Numbers (pairs x 2D) one tile task computes: large against a task's scheduling overhead,
# small enough that a cancelled job frees its worker soon (docs/jobs.md).
TILE_NUMBERS = 512 * 1024 * 1024
TILES_PER_WORKER = 4  # at least this many tiles per worker when the blocks allow it
LEAST_TILE_NUMBERS = 32 * 1024 * 1024  # a smaller tile's work is not large against its overhead
# Blocks in one tile: its losses (one number per block) are held while it runs, whatever is asked.
TILE_BLOCKS = 4 * 1024 * 1024
REDUCE_FAN_IN = 8  # partials summed by one reduction task
FINISH_FAN_IN = 16  # a job of at most this many tiles is finished from its tiles, without bands
ROWS, COLS = "rows", "cols"  # the two kinds of band
JOB_OUTPUTS = ("accumulated", "losses")


@dataclass(frozen=True)
class JobSpec:
    """What every task of one job needs besides the vectors (and a model's program)."""
    n: int
    dim: int
    factor: int
    objective: str  # a built-in objective's or a model's name
    offset: float
    dtype: str
    chunk_elements: int  # numbers per chunk (engine.elements_per_chunk)
    outputs: tuple[str, ...] = JOB_OUTPUTS  # what the job returns: only these are moved and assembled
    program: str | None = None  # a model's program: the sha256 of its bytes (job_models.py)
    traceparent: str | None = None  # the W3C traceparent of the POST that made the job (its tasks' parent)


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
    """A tile's losses and its (rows + cols) x D share of dL/dV; (0, 0) when not asked for."""
    rows: range
    cols: range
    row_start: int  # first row of V the tile's rows cover
    col_start: int
    losses: np.ndarray  # (len(rows), len(cols))
    row_sums: np.ndarray  # (tile rows of V, D)
    col_sums: np.ndarray  # (tile columns of V, D)
    started_at: float  # time.time() when the task began
    bad_block: tuple[int, int] | None  # the tile's first block that is not finite, row-major
    error: dict | None = None  # {"code", "message", "details"}: the tile could not be computed

    @property
    def nbytes(self) -> int:
        return self.losses.nbytes + self.row_sums.nbytes + self.col_sums.nbytes


@dataclass
class BandSum:
    """The shares of some tiles onto one range of V's rows: tiles of one tile row (their
    row shares, and their losses) or of one tile column (their column shares)."""
    start: int  # first row of V
    sums: np.ndarray  # (band rows, D)
    losses: list[tuple[int, int, np.ndarray]]  # (first block row, first block column, losses) per tile
    started_at: float
    bad_block: tuple[int, int] | None
    error: dict | None
    bytes_moved: int  # bytes of the partials and sums this one was made from

    @property
    def nbytes(self) -> int:
        return self.sums.nbytes + sum(piece.nbytes for _, _, piece in self.losses)


@dataclass
class JobOutcome:
    accumulated: np.ndarray | None  # (N, D), (0, 0) when not asked for, None when failed
    losses: np.ndarray | None  # (F, F), likewise
    error: dict | None  # {"code", "message", "details"} when failed
    started_at: float
    finished_at: float
    bytes_moved: int
    summary: dict = field(default_factory=dict)


def plan_tiles(n: int, dim: int, factor: int, workers: int = 1, tile_numbers: int = TILE_NUMBERS,
               least_numbers: int = LEAST_TILE_NUMBERS) -> list[Tile]:
    """Square tiles of whole blocks, row-major, each about tile_numbers numbers (at least one
    block, at most TILE_BLOCKS); more and smaller while there are fewer than TILES_PER_WORKER
    per worker, but no smaller than least_numbers unless that leaves a worker without a tile."""
    base = max(1, n // factor)
    per_block = base * base * 2 * dim
    side = max(1, min(math.isqrt(TILE_BLOCKS), math.isqrt(max(1, tile_numbers // per_block))))
    total = n * n * 2 * dim
    wanted = max(workers, min(TILES_PER_WORKER * max(1, workers), total // least_numbers))
    side = max(1, min(side, math.ceil(factor / math.ceil(math.sqrt(wanted)))))
    tiles = []
    for r0 in range(0, factor, side):
        for c0 in range(0, factor, side):
            tiles.append(Tile(len(tiles), range(r0, min(factor, r0 + side)), range(c0, min(factor, c0 + side))))
    return tiles


def tile_spans(spec: JobSpec, tile: Tile) -> tuple[int, int, int, int]:
    """(first row, rows, first column, columns) of V the tile covers."""
    bounds = block_bounds(spec.n, spec.factor)
    row_start, col_start = bounds[tile.rows.start], bounds[tile.cols.start]
    return row_start, bounds[tile.rows.stop] - row_start, col_start, bounds[tile.cols.stop] - col_start


def run_tile(vectors: np.ndarray, spec: JobSpec, tile: Tile, objective: Objective) -> TilePartial:
    """Every block of the tile: its losses and its chain-rule sums onto V's rows and columns,
    pass one as /v1 runs it (run.PassOne), on the tile's blocks."""
    started_at = time.time()
    torch.set_num_threads(1)  # one core per task, and the same loss bits as /v1's one thread
    v = torch.as_tensor(vectors, dtype=DTYPES[spec.dtype].torch)  # (N, D)
    computed = PassOne(SerialExecutor(), v, spec.factor, spec.chunk_elements, objective, spec.offset,
                       tile.rows, tile.cols)
    for _ in computed:
        pass
    bad = None if computed.surely_finite() else computed.first_non_finite_block()
    return tile_partial(spec, tile, computed.losses.numpy(), computed.rows_sum.numpy(), computed.cols_sum.numpy(),
                        started_at, bad)


def failed_tile(spec: JobSpec, tile: Tile, error: dict) -> TilePartial:
    """A tile that could not be computed (its objective did not load): zeros and the error."""
    _, height, _, width = tile_spans(spec, tile)
    dtype = np.dtype(spec.dtype)
    return tile_partial(spec, tile, np.zeros((len(tile.rows), len(tile.cols)), dtype),
                        np.zeros((height, spec.dim), dtype), np.zeros((width, spec.dim), dtype), time.time(), None,
                        error)


def tile_partial(spec: JobSpec, tile: Tile, losses: np.ndarray, row_sums: np.ndarray, col_sums: np.ndarray,
                 started_at: float, bad: tuple[int, int] | None, error: dict | None = None) -> TilePartial:
    """What the tile sends on: only the outputs asked for."""
    row_start, _, col_start, _ = tile_spans(spec, tile)
    losses, sums = asked(spec, "losses", losses), asked(spec, "accumulated", row_sums, col_sums)
    return TilePartial(tile.rows, tile.cols, row_start, col_start, *losses, *sums, started_at, bad, error)


def asked(spec: JobSpec, output: str, *arrays: np.ndarray) -> list[np.ndarray]:
    """The arrays, or empty (0, 0) ones when the job did not ask for `output`."""
    return [array if output in spec.outputs else np.zeros((0, 0), array.dtype) for array in arrays]


def band_share(kind: str, part: "TilePartial | BandSum") -> tuple[int, np.ndarray, list, int]:
    """(first row of V, sums, loss pieces, bytes) a part brings to a band of this kind."""
    if isinstance(part, BandSum):
        return part.start, part.sums, part.losses, part.bytes_moved + part.nbytes
    if kind == ROWS:  # a tile's losses travel with its row share only, so that they count once
        return part.row_start, part.row_sums, [(part.rows.start, part.cols.start, part.losses)], \
            part.row_sums.nbytes + part.losses.nbytes
    return part.col_start, part.col_sums, [], part.col_sums.nbytes


def add_band(kind: str, *parts: "TilePartial | BandSum") -> BandSum:
    """Parts that cover the same rows of V (kind: which of a tile's shares) summed, in the
    order given, into one band."""
    start, first, losses, moved = band_share(kind, parts[0])
    sums = first.copy()
    for part in parts[1:]:
        part_start, part_sums, part_losses, part_bytes = band_share(kind, part)
        if part_start != start or part_sums.shape != sums.shape:
            raise ValueError(f"a band of rows {start}+{sums.shape[0]} got a share of rows {part_start}+"
                             f"{part_sums.shape[0]}")
        sums += part_sums
        losses = losses + part_losses
        moved += part_bytes
    errors = [part.error for part in parts if part.error is not None]
    bad = [tuple(part.bad_block) for part in parts if part.bad_block is not None]
    return BandSum(start, sums, losses, min(part.started_at for part in parts), min(bad, default=None),
                   errors[0] if errors else None, moved)


def reduction_levels(count: int, fan_in: int = REDUCE_FAN_IN) -> list[list[range]]:
    """The tree: at each level, which consecutive items of the level below each task sums."""
    levels = []
    while count > 1 or not levels:
        groups = [range(k, min(count, k + fan_in)) for k in range(0, count, fan_in)]
        levels.append(groups)
        count = len(groups)
    return levels


def band_groups(tiles: list[Tile]) -> dict[str, list[list[int]]]:
    """Which tiles share a band: by tile row (their rows of V) and by tile column."""
    groups: dict[str, dict[int, list[int]]] = {ROWS: {}, COLS: {}}
    for k, tile in enumerate(tiles):
        groups[ROWS].setdefault(tile.rows.start, []).append(k)
        groups[COLS].setdefault(tile.cols.start, []).append(k)
    return {kind: [members for _, members in sorted(by_start.items())] for kind, by_start in groups.items()}


def finish(spec: JobSpec, *parts: "BandSum | TilePartial") -> JobOutcome:
    """The bands (or, for a small job, the tiles themselves) added into the job's answer, or
    the error /v1 would give for the same body and outputs (but for an accumulated gradient whose
    sum overflows, an error only when it is asked for: docs/jobs.md)."""
    dtype = np.dtype(spec.dtype)
    accumulated = np.zeros((spec.n, spec.dim) if "accumulated" in spec.outputs else (0, 0), dtype)  # (N, D)
    losses = np.zeros((spec.factor, spec.factor) if "losses" in spec.outputs else (0, 0), dtype)  # (F, F)
    moved = 0
    for part in parts:
        for start, sums, pieces, nbytes in shares(part):
            accumulated[start:start + sums.shape[0]] += sums
            for r0, c0, piece in pieces:  # copied, not added: a -0.0 stays -0.0
                losses[r0:r0 + piece.shape[0], c0:c0 + piece.shape[1]] = piece
            moved += nbytes
    errors = [part.error for part in parts if part.error is not None]
    bad = min((part.bad_block for part in parts if part.bad_block is not None), default=None)
    error = errors[0] if errors else None
    if error is None and bad is not None:
        error = non_finite_block(*bad, spec.dtype).as_dict()
    elif error is None and not np.isfinite(accumulated).all():
        error = non_finite_accumulated(spec.dtype).as_dict()
    failed = error is not None  # then no numbers are kept
    return JobOutcome(None if failed else accumulated, None if failed else losses, error,
                      min(part.started_at for part in parts), time.time(), moved)


def shares(part: "BandSum | TilePartial") -> list[tuple[int, np.ndarray, list, int]]:
    """What a part adds to the job: a band's one share, a tile's row and column shares."""
    if isinstance(part, BandSum):
        return [band_share(ROWS, part)]
    return [band_share(ROWS, part), band_share(COLS, part)]
