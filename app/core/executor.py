"""Runs a request's tiles (the engine's chunks) over up to k compute slots at once.

The calling thread computes on the slot the request already holds (lane 0). Before
each tile, the executor takes one more slot if one is free right now and nobody waits
for one (`SlotSource.try_acquire`), hands that tile to a pool thread (a lane of its
own), and gives the slot back as soon as the tile is done: a request that arrives
meanwhile gets a slot at the next tile boundary, and a burst degrades to one slot per
request. torch releases the GIL inside its kernels, so with one torch thread per
process (torch.set_num_threads(1)) each lane keeps one core busy.

Results come back in the tiles' order (row-block-major). A tile's losses and gradient
are the same computation as the serial engine's, only on another thread, so the same
bits. Each lane sums its tiles' chain-rule shares into a partial accumulated gradient
of its own; the partials are added at the end, so the accumulated gradient differs
from the serial one only in the order of the additions.

A request of one tile runs inline, with no hand-over. Tiles are sized for the cache
when they may run in parallel (PARALLEL_TILE_ELEMENTS; docs/cores.md).

`TileExecutor` is the seam for other back ends (a Dask cluster): anything that can
run `pass_one` and `map_tiles` with these guarantees. Pure: torch and the standard
library only; the slots (app/core/slots.py, or the pod's: app/serving/slots.py) are supplied.
"""
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for_futures
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from .engine import Chunk, ChunkResult, ChunkSums, chain_rule_sums, chunk_gradients
from .objectives import Objective
from .slots import Slot, SlotSource

# Numbers per tile when a request may run on several slots: two lanes' working sets
# then fit the shared cache together (docs/cores.md, "Tile size").
PARALLEL_TILE_ELEMENTS = 256 * 1024
# Tiles computed ahead of the one the consumer waits for, per lane: bounds the results
# held while a pool lane is slower than the calling thread.
LOOKAHEAD_PER_LANE = 2

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class TileResult:
    result: ChunkResult
    # True proves every block of the tile finite: the sum of its losses and of its
    # chain-rule shares is finite only if all their terms are (app/core/run.py).
    surely_finite: torch.Tensor  # 0-d bool


class PassOne:
    """Pass one's tiles in order, then the sum of the lanes' partial accumulated gradients."""

    def __init__(self, results: Iterator[TileResult], partials: list[torch.Tensor | None],
                 like: torch.Tensor):
        self._results, self._partials, self._like = results, partials, like

    def __iter__(self) -> Iterator[TileResult]:
        return self._results

    def close(self) -> None:
        """Stop early (a deadline, a gone client): waits for the tiles in flight, frees their slots."""
        close = getattr(self._results, "close", None)
        if close is not None:
            close()

    def accumulated(self) -> torch.Tensor:
        """dL/dV, (N, D): call once the results are consumed."""
        total = None
        for partial in self._partials:
            if partial is None:
                continue
            if total is None:
                total = partial
            else:
                total += partial
        return torch.zeros_like(self._like) if total is None else total


class TileExecutor(Protocol):
    parallel: bool  # whether tiles may run side by side (then cache-sized: tile_elements)
    most_lanes: int  # the most slots one request may compute on at once (memory is reserved for them)

    def map_tiles(self, fn: Callable[[T], R], tiles: Sequence[T]) -> Iterator[R]:
        """fn(tile) for every tile, results in the tiles' order; closing the iterator early
        waits for the tiles in flight and gives their slots back."""

    def pass_one(self, vectors: torch.Tensor, tiles: Sequence[Chunk], objective: Objective,
                 offset: float) -> PassOne:
        """Every tile's losses, gradients and finiteness in order; partial accumulated
        gradients summed by `PassOne.accumulated`."""


def tile_elements(chunk_elements: int, parallel: bool) -> int:
    """Numbers per tile: the engine's chunk, smaller when tiles may run side by side."""
    return min(chunk_elements, PARALLEL_TILE_ELEMENTS) if parallel else chunk_elements


def tile_shares(vectors: torch.Tensor, chunk: Chunk, objective: Objective,
                offset: float) -> tuple[TileResult, ChunkSums]:
    """One tile's computation, whatever runs it (these lanes, a job's task on a cluster): its
    blocks' losses and gradients, whether they are surely finite, and their chain-rule shares
    onto V's rows (kr * h, D) and columns (kc * w, D) from the tile's first row and column."""
    result = chunk_gradients(vectors, chunk, objective, offset)
    sums = chain_rule_sums(result)
    return TileResult(result, torch.isfinite(result.losses.sum() + sums.rows.sum() + sums.cols.sum())), sums


def tile_result(vectors: torch.Tensor, chunk: Chunk, objective: Objective, offset: float,
                partial: torch.Tensor) -> TileResult:
    """One tile of pass one: its blocks' losses and gradients, its share added to `partial`."""
    tile, sums = tile_shares(vectors, chunk, objective, offset)
    row_start, col_start = chunk.rows.start * chunk.base, chunk.cols.start * chunk.base
    partial[row_start:row_start + sums.rows.shape[0]] += sums.rows  # (kr * h, D)
    partial[col_start:col_start + sums.cols.shape[0]] += sums.cols  # (kc * w, D)
    return tile


class LocalExecutor:
    """Tiles on this process's pool threads, one slot per lane from `slots`.

    One per process: the pool is shared by its requests, `threads` big enough for every
    slot the process may hold beside the requests' own. `slots_per_request` caps the lanes
    one request uses (1: serial, on the calling thread only)."""

    def __init__(self, slots: SlotSource, slots_per_request: int, threads: int | None = None):
        if slots_per_request < 1:
            raise ValueError("slots_per_request must be at least 1")
        self.slots = slots
        self.slots_per_request = slots_per_request
        workers = threads if threads is not None else max(1, slots_per_request - 1)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tile") \
            if slots_per_request > 1 else None

    @property
    def parallel(self) -> bool:
        return self._pool is not None

    @property
    def most_lanes(self) -> int:
        return self.slots_per_request if self.parallel else 1

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def map_tiles(self, fn: Callable[[T], R], tiles: Sequence[T]) -> Iterator[R]:
        return self._map(lambda tile, lane: fn(tile), tiles)

    def pass_one(self, vectors: torch.Tensor, tiles: Sequence[Chunk], objective: Objective,
                 offset: float) -> PassOne:
        partials: list[torch.Tensor | None] = [None] * self.lanes_for(len(tiles))

        def one(chunk: Chunk, lane: int) -> TileResult:
            if partials[lane] is None:  # a lane's tiles never run at once: no lock needed
                partials[lane] = torch.zeros_like(vectors)  # (N, D)
            return tile_result(vectors, chunk, objective, offset, partials[lane])

        return PassOne(self._map(one, tiles), partials, vectors)

    def lanes_for(self, count: int) -> int:
        """The most lanes a request of `count` tiles may use at once."""
        return max(1, min(self.slots_per_request, count)) if self.parallel else 1

    def _map(self, fn: Callable[[T, int], R], tiles: Sequence[T]) -> Iterator[R]:
        count, lanes = len(tiles), self.lanes_for(len(tiles))
        if lanes == 1:
            for tile in tiles:
                yield fn(tile, 0)
            return
        window = LOOKAHEAD_PER_LANE * lanes
        extras: dict[int, tuple[Future, int, Slot]] = {}  # tile index -> (future, lane, slot)
        inline: dict[int, R] = {}  # tile index -> result computed by this thread
        issued = done = 0  # tiles started; tiles handed to the consumer
        try:
            while done < count:
                busy = {lane for future, lane, _ in extras.values() if not future.done()}
                while issued < count and issued - done < window and len(busy) < lanes - 1:
                    slot = self.slots.try_acquire()
                    if slot is None:
                        break
                    lane = min(set(range(1, lanes)) - busy)
                    extras[issued] = (self._pool.submit(on_slot, fn, tiles[issued], lane, slot), lane, slot)
                    busy.add(lane)
                    issued += 1
                if done in inline:
                    yield inline.pop(done)
                elif done in extras and extras[done][0].done():
                    yield extras.pop(done)[0].result()
                elif issued < count and issued - done < window:
                    inline[issued] = fn(tiles[issued], 0)
                    issued += 1
                    continue
                else:
                    yield extras.pop(done)[0].result()  # nothing left to do here: wait for it
                done += 1
        finally:
            for future, _, _ in extras.values():
                future.cancel()
            wait_for_futures([future for future, _, _ in extras.values()])
            for _, _, slot in extras.values():
                slot.release()  # the cancelled ones never ran to release theirs


def on_slot(fn: Callable[[T, int], R], tile: T, lane: int, slot: Slot) -> R:
    try:
        return fn(tile, lane)
    finally:
        slot.release()  # at the tile boundary, so that a waiting request gets it now


class SerialExecutor:
    """Every tile on the calling thread: a device other than the CPU, or one slot per request."""
    parallel = False
    most_lanes = 1

    def map_tiles(self, fn: Callable[[T], R], tiles: Sequence[T]) -> Iterator[R]:
        return (fn(tile) for tile in tiles)

    def pass_one(self, vectors: torch.Tensor, tiles: Sequence[Chunk], objective: Objective,
                 offset: float) -> PassOne:
        partials: list[torch.Tensor | None] = [torch.zeros_like(vectors)]  # (N, D)
        return PassOne((tile_result(vectors, chunk, objective, offset, partials[0]) for chunk in tiles),
                       partials, vectors)
