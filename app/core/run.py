"""The one run function both front ends call (through app/http/pipeline.py, which has
admitted the request): place, compute, check.

Pass one computes every block's loss and its share of the accumulated gradient
and proves every block finite, so that an error is known before the first byte
of a 200 is sent. The blocks themselves are taken from the result afterwards
(`Result.blocks()`): kept from pass one while their gradients hold no more
memory than one largest block may (autograd often returns a view of one number,
e.g. for `sum`), else recomputed a band of chunks at a time as they are
consumed (app/core/engine.py), so that memory stays bounded by a chunk, not by
N x N x 2D.
"""
import itertools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from .deadline import Deadline
from .device import ready_device, release_device_memory
from .engine import (DEFAULT_CHUNK_ELEMENTS, Block, band_blocks, block_bounds, chunk_gradients, elements_per_chunk,
                     plan_bands)
from .errors import device_out_of_memory, non_finite_accumulated, non_finite_block
from .executor import Executor, PassOne, SerialExecutor
from .heap import watch_for
from .request import GradientRequest
from .settings import Settings


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
    # Held while a band is recomputed, not while its blocks are written: a compute slot,
    # supplied by whoever owns the slots (app/http/slot.py); nothing by default.
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
    chunks and hands them back in order (app/core/executor.py)."""
    keep, kept, kept_bytes = "blocks" in req.outputs, [], 0
    # Kept blocks fragment glibc's heap (app/core/heap.py); a pass that keeps none does not grow it.
    heap = watch_for(req.n * req.n * 2 * req.dim * vectors.element_size()) if keep else None
    computed = PassOne(executor or SerialExecutor(), vectors, req.factor, chunk_elements, req.objective_fn,
                       req.offset)
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
                  chunk_elements=chunk_elements)
