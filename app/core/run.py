"""Running one admitted request: pass one over the blocks on its lanes, then its blocks.

`run` is the one function both front ends call (through app/http/pipeline.py, which has
admitted the request): place, compute, check. Pass one computes every block's loss and
its share of the accumulated gradient and proves every block finite, so that an error is
known before the first byte of a 200 is sent. The blocks themselves are taken from the
result afterwards (`Result.blocks()`): kept from pass one while their gradients hold no
more memory than one largest block may (autograd often returns a view of one number, e.g.
for `sum`), else recomputed a band of chunks at a time as they are consumed
(app/core/engine.py), so that memory stays bounded by a chunk, not by N x N x 2D.

Pass one's chunks run over up to k compute slots at once (`LocalExecutor`). The calling
thread computes on the slot the request already holds (lane 0). Each other lane is a pool
thread on a slot taken only if one is free right now and nobody waits for one
(`SlotSource.try_acquire`); it computes chunk after chunk, giving its slot back at each
chunk boundary and taking one again on the same terms (`ChunkRun`): a request that arrives
meanwhile gets a slot at the next chunk boundary, and a burst degrades to one slot per
request. torch releases the GIL inside its kernels, so with one torch thread per process
(torch.set_num_threads(1)) each lane keeps one core busy.

Results come back in the chunks' order (row-block-major), and `PassOne` adds each chunk's
chain-rule sums as it is consumed: a chunk is the same computation as the serial engine's,
only on another thread, so blocks, losses and the accumulated gradient are the serial bits
on any number of lanes. A request of one chunk runs inline, with no hand-over. Chunks are
sized for the cache when they may run in parallel (engine.PARALLEL_CHUNK_ELEMENTS;
docs/cores.md).

`Executor` is the seam for other back ends: anything that can `map_chunks` with these
guarantees. The slots (app/core/slots.py, or the pod's: app/serving/slots.py) are supplied.
"""
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for_futures
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch

from .device import ready_device, release_device_memory
from .engine import (DEFAULT_CHUNK_ELEMENTS, Block, Chunk, ChunkResult, ChunkSums, add_to_vectors, band_blocks,
                     block_bounds, chain_rule_sums, chunk_gradients, elements_per_chunk, plan_bands)
from .errors import device_out_of_memory, non_finite_accumulated, non_finite_block
from .heap import watch_for
from .objectives import Objective
from .request import GradientRequest
from .settings import Settings
from .slots import Deadline, Slot, SlotSource

# Chunks computed ahead of the one the consumer waits for, per lane: bounds the results
# held while a pool lane is slower than the calling thread.
LOOKAHEAD_PER_LANE = 2
# While no extra slot is free, a request tries again after 1, 2, 4 ... at most this many
# chunks: a try costs a few system calls on the pod's slots, a chunk under a millisecond.
MOST_CHUNKS_BETWEEN_TRIES = 16

T = TypeVar("T")
R = TypeVar("R")


class Executor(Protocol):
    parallel: bool  # whether chunks may run side by side (then cache-sized: engine.elements_per_chunk)
    most_lanes: int  # the most slots one request may compute on at once (memory is reserved for them)

    def map_chunks(self, fn: Callable[[T], R], chunks: Sequence[T]) -> Iterator[R]:
        """fn(chunk) for every chunk, results in the chunks' order; closing the iterator early
        waits for the chunks in flight and gives their slots back."""


class PassOne:
    """Pass one over the blocks rows x cols (all of them by default; a job's tile otherwise),
    planned by engine.plan_bands: each chunk computed by `executor` (its blocks' losses and
    gradients, their chain-rule sums), handed back in plan order. As a chunk is consumed its
    losses are placed in `losses` (rows x cols) and its sums added (engine.add_to_vectors)
    into `rows_sum` and `cols_sum`: one (N, D) dL/dV for the whole matrix, a tile's own
    (rows, D) and (cols, D) shares for a tile. Adding in plan order gives the same bits on
    any number of lanes, whichever lane ran which chunk."""

    def __init__(self, executor: Executor, vectors: torch.Tensor, factor: int, chunk_elements: int,
                 objective: Objective, offset: float, rows: range | None = None, cols: range | None = None):
        (n, dim), tile = vectors.shape, rows is not None
        rows, cols = rows or range(factor), cols or range(factor)
        self.bands = list(plan_bands(n, dim, factor, chunk_elements, rows, cols))
        self.chunks = [chunk for band in self.bands for chunk in band]
        self.origin = (rows.start, cols.start)
        self.losses = torch.empty((len(rows), len(cols)), dtype=vectors.dtype, device=vectors.device)  # (R, C)
        if tile:
            bounds = block_bounds(n, factor)
            self.rows_sum = vectors.new_zeros((bounds[rows.stop] - bounds[rows.start], dim))  # (tile rows of V, D)
            self.cols_sum = vectors.new_zeros((bounds[cols.stop] - bounds[cols.start], dim))  # (tile cols of V, D)
        else:
            self.rows_sum = self.cols_sum = torch.zeros_like(vectors)  # (N, D)
        self._vectors, self._objective, self._offset = vectors, objective, offset

        def compute(chunk: Chunk) -> tuple[ChunkResult, ChunkSums]:  # on a lane
            result = chunk_gradients(vectors, chunk, objective, offset)
            return result, chain_rule_sums(result)
        self._computed = executor.map_chunks(compute, self.chunks)

    def __iter__(self) -> Iterator[ChunkResult]:
        for result, sums in self._computed:
            chunk = result.chunk
            r0, c0 = chunk.rows.start - self.origin[0], chunk.cols.start - self.origin[1]
            self.losses[r0:r0 + len(chunk.rows), c0:c0 + len(chunk.cols)] = result.losses  # (kr, kc)
            add_to_vectors(self.rows_sum, self.cols_sum, chunk, sums, self.origin)
            yield result

    def close(self) -> None:
        """Stop early (a deadline, a gone client): waits for the chunks in flight, frees their slots."""
        close = getattr(self._computed, "close", None)
        if close is not None:
            close()

    def surely_finite(self) -> bool:
        """Once consumed, with one synchronisation: True proves every loss, every gradient entry
        and every sum finite (a sum is finite only if all its terms are, and the chain-rule
        sums hold every gradient entry). False may also be an overflowing sum."""
        total = self.losses.sum() + self.rows_sum.sum()
        if self.cols_sum is not self.rows_sum:
            total = total + self.cols_sum.sum()
        return bool(torch.isfinite(total))

    def first_non_finite_block(self) -> tuple[int, int] | None:
        """Row-block-major, the first block whose loss or gradient is not finite, checked entry
        by entry: the chunks whose losses or sums hold a number that is not finite are computed
        again. None when only sums overflowed."""
        found = []
        for chunk in self.chunks:
            r0, c0 = chunk.rows.start - self.origin[0], chunk.cols.start - self.origin[1]
            row_start, col_start = r0 * chunk.base, c0 * chunk.base
            shares = (self.losses[r0:r0 + len(chunk.rows), c0:c0 + len(chunk.cols)],  # (kr, kc)
                      self.rows_sum[row_start:row_start + len(chunk.rows) * chunk.height],  # (kr * h, D)
                      self.cols_sum[col_start:col_start + len(chunk.cols) * chunk.width])  # (kc * w, D)
            if all(bool(torch.isfinite(share).all()) for share in shares):
                continue
            result = chunk_gradients(self._vectors, chunk, self._objective, self._offset)
            finite = torch.isfinite(result.losses) & torch.isfinite(result.gradient).flatten(2).all(dim=2)  # (kr, kc)
            found += [(chunk.rows[i], chunk.cols[j]) for i, j in torch.nonzero(~finite).tolist()]
        return min(found, default=None)


class LocalExecutor:
    """Chunks on this process's pool threads, one slot per lane from `slots`.

    One per process: the pool is shared by its requests, `threads` big enough for every
    slot the process may hold beside the requests' own. `slots_per_request` caps the lanes
    one request uses (1: serial, on the calling thread only)."""

    def __init__(self, slots: SlotSource, slots_per_request: int, threads: int | None = None):
        if slots_per_request < 1:
            raise ValueError("slots_per_request must be at least 1")
        self.slots = slots
        self.parallel = slots_per_request > 1
        self.most_lanes = slots_per_request
        workers = threads if threads is not None else max(1, slots_per_request - 1)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="chunk") if self.parallel else None

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def map_chunks(self, fn: Callable[[T], R], chunks: Sequence[T]) -> Iterator[R]:
        lanes = min(self.most_lanes, len(chunks))
        if lanes <= 1:
            yield from map(fn, chunks)
            return
        run = ChunkRun(fn, chunks, lanes, self.slots, self._pool)
        try:
            yield from run.results()
        finally:
            run.stop()


class ChunkRun:
    """One request's chunks over its lanes, results in the chunks' order.

    Lane 0 is the calling thread, on the request's own slot; it consumes the results and,
    whenever the next result is not ready, computes the next unclaimed chunk itself. Each
    other lane is a pool thread on a slot of its own that takes the next unclaimed chunk,
    one after another, without waiting for the caller: at each chunk boundary it gives its
    slot back and takes one again only if one is free and nobody waits (so a request that
    arrives meanwhile gets it now). A lane stops when no chunk may be claimed (all claimed,
    or LOOKAHEAD_PER_LANE x lanes chunks computed ahead of the consumer) or no slot is
    free; the caller starts it again, with a fresh slot, when there is work for it (and,
    while slots are scarce, tries for one only every few chunks)."""

    def __init__(self, fn: Callable[[T], R], chunks: Sequence[T], lanes: int, slots: SlotSource,
                 pool: ThreadPoolExecutor):
        self._fn, self._chunks, self._slots, self._pool = fn, chunks, slots, pool
        self._window = LOOKAHEAD_PER_LANE * lanes
        self._cond = threading.Condition()
        self._claimed = 0  # chunks claimed by a lane, in order
        self._consumed = 0  # chunks handed to the consumer
        self._ready: dict[int, tuple[bool, object]] = {}  # chunk index -> (ok, result or exception)
        self._idle = list(range(lanes - 1, 0, -1))  # pool lanes not running now
        self._started: list[tuple[Future, Slot]] = []
        self._stopped = False
        self._next_try, self._gap = 0, 1  # no extra slot tried before chunk `_next_try` is consumed

    def results(self) -> Iterator[R]:
        count = len(self._chunks)
        while self._consumed < count:
            self._start_lanes()
            with self._cond:
                index = self._consumed
                if index not in self._ready:
                    claim = self._claim()
                    if claim is None:  # every chunk up to the window is on a lane: wait for this one
                        self._cond.wait_for(lambda: index in self._ready)
                if index in self._ready:
                    ok, value = self._ready.pop(index)
                    self._consumed += 1
                    self._cond.notify_all()  # the window moved: a lane may claim again
                else:
                    ok = None
            if ok is None:
                self._compute(claim)
            elif ok:
                yield value
            else:
                raise value

    def stop(self) -> None:
        """No more chunks are claimed; waits for the lanes' chunks in flight, frees their slots."""
        with self._cond:
            self._stopped = True
            started = list(self._started)
        for future, slot in started:
            if future.cancel():
                slot.release()  # never ran to release its own
        wait_for_futures([future for future, _ in started])

    def _claimable(self) -> bool:
        """Under the lock: whether a chunk may be claimed now (not stopped, one left, within the window)."""
        return not self._stopped and self._claimed < len(self._chunks) and self._claimed - self._consumed < self._window

    def _claim(self) -> int | None:
        """The next chunk to compute, under the lock; None when none may be claimed now."""
        if not self._claimable():
            return None
        self._claimed += 1
        return self._claimed - 1

    def _compute(self, index: int) -> None:
        try:
            outcome = (True, self._fn(self._chunks[index]))
        except BaseException as exc:  # raised in the consumer, in order
            outcome = (False, exc)
        with self._cond:
            self._ready[index] = outcome
            self._cond.notify_all()

    def _start_lanes(self) -> None:
        """Idle lanes on slots free right now, while there are chunks they may claim; after a
        try that found none, the next only some chunks later (MOST_CHUNKS_BETWEEN_TRIES)."""
        while True:
            with self._cond:
                if not self._idle or not self._claimable() or self._consumed < self._next_try:
                    return
            slot = self._slots.try_acquire()
            if slot is None:
                self._next_try = self._consumed + self._gap
                self._gap = min(2 * self._gap, MOST_CHUNKS_BETWEEN_TRIES)
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
                self._compute(index)
                slot.release()  # the chunk boundary: a request waiting for a slot takes it now
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
    """Every chunk on the calling thread: a device other than the CPU, or one slot per request."""
    parallel = False
    most_lanes = 1

    def map_chunks(self, fn: Callable[[T], R], chunks: Sequence[T]) -> Iterator[R]:
        return map(fn, chunks)


@contextmanager
def device_memory_guard() -> Iterator[None]:
    """Out of device memory: free what the request held, then a domain error."""
    try:
        yield
    except torch.OutOfMemoryError as exc:  # torch.cuda.OutOfMemoryError is the same class
        release_device_memory(exc)
        raise device_out_of_memory() from None


def load_vectors(req: GradientRequest, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(req.vectors, dtype=getattr(torch, req.dtype), device=device)  # (N, D)


@dataclass
class Result:
    request: GradientRequest
    device: torch.device
    bounds: list[int]  # F + 1
    losses: torch.Tensor  # (F, F)
    accumulated: torch.Tensor  # (N, D)
    vectors: torch.Tensor = field(repr=False)  # (N, D), on `device`
    deadline: Deadline = field(repr=False)
    kept: list[Block] | None = field(default=None, repr=False)  # every block, when they fit
    chunk_elements: int = field(default=DEFAULT_CHUNK_ELEMENTS, repr=False)  # numbers per chunk
    planned: tuple[int, int] = field(default=(0, 0), repr=False)  # pass one's (bands, chunks), for its trace span
    # Held while a band is recomputed, not while its blocks are written: a compute slot,
    # supplied by whoever owns the slots (app/http/pipeline.py); nothing by default.
    band_slot: Callable[[], AbstractContextManager] = field(default=nullcontext, repr=False)

    def blocks(self) -> Iterator[Block]:
        """Every block, row-block-major: kept, or recomputed a band of chunks at a time as
        consumed (each band on `band_slot`), the deadline then checked between blocks. Kept
        blocks are not checked: the deadline is for computing, not for a client's download
        (a stalled one meets the send timeout)."""
        req = self.request
        with device_memory_guard():
            if self.kept is not None:
                yield from self.kept
                return
            for band in plan_bands(req.n, req.dim, req.factor, self.chunk_elements):
                with self.band_slot():
                    results = [chunk_gradients(self.vectors, chunk, req.objective_fn, req.offset) for chunk in band]
                for block in band_blocks(results):
                    yield block
                    self.deadline.check()


def run(req: GradientRequest, settings: Settings, deadline: Deadline | None = None,
        executor: Executor | None = None) -> Result:
    """Compute an admitted request on this worker's device (app/core/admission.py admits);
    `executor` runs pass one's chunks (on CPU, over the free compute slots), serial elsewhere."""
    device = ready_device(settings.device)  # not_ready (503), as /readyz says, when it cannot compute
    deadline = deadline or Deadline(settings.request_timeout_s)
    if executor is None or device.type != "cpu":
        executor = SerialExecutor()
    with device_memory_guard():
        vectors = load_vectors(req, device)  # (N, D)
        chunk = elements_per_chunk(settings.max_block_elements, req.objective_fn, req.dim, vectors.element_size(),
                                   executor.parallel)
        return pass_one(req, device, vectors, deadline, settings.max_block_elements * vectors.element_size(),
                        chunk, executor)


def pass_one(req: GradientRequest, device: torch.device, vectors: torch.Tensor, deadline: Deadline,
             keep_bytes: int, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
             executor: Executor | None = None) -> Result:
    """Pass one: losses (F, F) and accumulated (N, D); non_finite_result if anything is not finite.

    Blocks' gradients are kept (for `blocks()`) while they hold at most keep_bytes: autograd
    often returns a view of a few numbers (e.g. for `sum`); past that they are let go and
    recomputed as consumed, so memory stays bounded by a band of chunks, not by N x N x 2D.
    No host synchronisation per block or chunk: one at the end. `executor` computes the
    chunks and hands them back in order."""
    keep, kept, kept_bytes = "blocks" in req.outputs, [], 0
    # Kept blocks fragment glibc's heap (app/core/heap.py); a pass that keeps none does not grow it.
    heap = watch_for(req.n * req.n * 2 * req.dim * vectors.element_size()) if keep else None
    computed = PassOne(executor or SerialExecutor(), vectors, req.factor, chunk_elements, req.objective_fn, req.offset)
    results = iter(computed)
    try:
        for band in computed.bands:
            band_results = list(itertools.islice(results, len(band)))
            if keep:
                kept_bytes += sum(result.gradient.untyped_storage().nbytes() for result in band_results)
                keep = kept_bytes <= keep_bytes  # over budget: let them go, blocks() recomputes
            if keep:
                kept.extend(band_blocks(band_results))
            else:
                kept.clear()  # let go of what was kept before the budget ran out
            if heap is not None:
                heap.check()
            deadline.check()
    finally:
        computed.close()  # stopped early: the chunks in flight end and give their slots back
    accumulated = computed.rows_sum  # (N, D)
    if not computed.surely_finite():  # the one synchronisation
        first = computed.first_non_finite_block()
        if first is not None:
            raise non_finite_block(*first, req.dtype)
        if not bool(torch.isfinite(accumulated).all()):
            raise non_finite_accumulated(req.dtype)
    return Result(req, device, bounds=block_bounds(req.n, req.factor), losses=computed.losses,
                  accumulated=accumulated, vectors=vectors, deadline=deadline, kept=kept if keep else None,
                  chunk_elements=chunk_elements, planned=(len(computed.bands), len(computed.chunks)))
