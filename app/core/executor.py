"""Runs a request's tiles (the engine's chunks) over up to k compute slots at once.

The calling thread computes on the slot the request already holds (lane 0). Each other
lane is a pool thread on a slot taken only if one is free right now and nobody waits for
one (`SlotSource.try_acquire`); it computes tile after tile, giving its slot back at each
tile boundary and taking one again on the same terms (`TileRun`): a request that arrives
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
import threading
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
# While no extra slot is free, a request tries again after 1, 2, 4 ... at most this many
# tiles: a try costs a few system calls on the pod's slots, a tile under a millisecond.
MOST_TILES_BETWEEN_TRIES = 16

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
        lanes = self.lanes_for(len(tiles))
        if lanes == 1:
            for tile in tiles:
                yield fn(tile, 0)
            return
        run = TileRun(fn, tiles, lanes, self.slots, self._pool)
        try:
            yield from run.results()
        finally:
            run.stop()


class TileRun:
    """One request's tiles over its lanes, results in the tiles' order.

    Lane 0 is the calling thread, on the request's own slot; it consumes the results and,
    whenever the next result is not ready, computes the next unclaimed tile itself. Each
    other lane is a pool thread on a slot of its own that takes the next unclaimed tile,
    one after another, without waiting for the caller: at each tile boundary it gives its
    slot back and takes one again only if one is free and nobody waits (so a request that
    arrives meanwhile gets it now). A lane stops when no tile may be claimed (all claimed,
    or LOOKAHEAD_PER_LANE x lanes tiles computed ahead of the consumer) or no slot is
    free; the caller starts it again, with a fresh slot, when there is work for it (and,
    while slots are scarce, tries for one only every few tiles)."""

    def __init__(self, fn: Callable[[T, int], R], tiles: Sequence[T], lanes: int, slots: SlotSource,
                 pool: ThreadPoolExecutor):
        self._fn, self._tiles, self._slots, self._pool = fn, tiles, slots, pool
        self._window = LOOKAHEAD_PER_LANE * lanes
        self._cond = threading.Condition()
        self._claimed = 0  # tiles claimed by a lane, in order
        self._consumed = 0  # tiles handed to the consumer
        self._ready: dict[int, tuple[bool, object]] = {}  # tile index -> (ok, result or exception)
        self._idle = list(range(lanes - 1, 0, -1))  # pool lanes not running now
        self._started: list[tuple[Future, Slot]] = []
        self._stopped = False
        self._next_try, self._gap = 0, 1  # no extra slot tried before tile `_next_try` is consumed

    def results(self) -> Iterator[R]:
        count = len(self._tiles)
        while self._consumed < count:
            self._start_lanes()
            with self._cond:
                index = self._consumed
                if index not in self._ready:
                    claim = self._claim()
                    if claim is None:  # every tile up to the window is on a lane: wait for this one
                        self._cond.wait_for(lambda: index in self._ready)
                if index in self._ready:
                    ok, value = self._ready.pop(index)
                    self._consumed += 1
                    self._cond.notify_all()  # the window moved: a lane may claim again
                else:
                    ok = None
            if ok is None:
                self._compute(claim, 0)
            elif ok:
                yield value
            else:
                raise value

    def stop(self) -> None:
        """No more tiles are claimed; waits for the lanes' tiles in flight, frees their slots."""
        with self._cond:
            self._stopped = True
            started = list(self._started)
        for future, slot in started:
            if future.cancel():
                slot.release()  # never ran to release its own
        wait_for_futures([future for future, _ in started])

    def _claim(self) -> int | None:
        """The next tile to compute, under the lock; None when none may be claimed now."""
        if self._stopped or self._claimed >= len(self._tiles) or self._claimed - self._consumed >= self._window:
            return None
        self._claimed += 1
        return self._claimed - 1

    def _compute(self, index: int, lane: int) -> None:
        try:
            outcome = (True, self._fn(self._tiles[index], lane))
        except BaseException as exc:  # raised in the consumer, in order
            outcome = (False, exc)
        with self._cond:
            self._ready[index] = outcome
            self._cond.notify_all()

    def _start_lanes(self) -> None:
        """Idle lanes on slots free right now, while there are tiles they may claim; after a
        try that found none, the next only some tiles later (MOST_TILES_BETWEEN_TRIES)."""
        while True:
            with self._cond:
                if not self._idle or self._stopped or self._claimed >= len(self._tiles) \
                        or self._claimed - self._consumed >= self._window or self._consumed < self._next_try:
                    return
            slot = self._slots.try_acquire()
            if slot is None:
                self._next_try = self._consumed + self._gap
                self._gap = min(2 * self._gap, MOST_TILES_BETWEEN_TRIES)
                return
            self._gap = 1
            with self._cond:
                lane = self._idle.pop()
                try:
                    self._started.append((self._pool.submit(self._lane, lane, slot), slot))
                except BaseException:  # the pool shut down: the slot was never handed over
                    self._idle.append(lane)
                    slot.release()
                    raise

    def _lane(self, lane: int, slot: Slot) -> None:
        try:
            while True:
                with self._cond:
                    index = self._claim()
                if index is None:
                    return
                self._compute(index, lane)
                slot.release()  # the tile boundary: a request waiting for a slot takes it now
                slot = None  # released: not again in `finally` if taking another one raises
                slot = self._slots.try_acquire()
                if slot is None:
                    return
        finally:
            if slot is not None:
                slot.release()
            with self._cond:
                self._idle.append(lane)


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
