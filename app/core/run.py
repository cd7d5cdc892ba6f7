"""The one run function both front ends call: admit, place, compute, check.

Pass one computes every block's loss and its share of the accumulated gradient
and proves every block finite, so that an error is known before the first byte
of a 200 is sent. The blocks themselves are taken from the result afterwards
(`Result.blocks()`): kept from pass one while their gradients hold no more
memory than one largest block may (autograd often returns a view of one number,
e.g. for `sum`), else recomputed one at a time as they are consumed, so that
memory stays bounded by a block, not by N x N x 2D.
"""
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .device import release_device_memory, resolve_device
from .engine import Block, add_to_vectors, block_at, block_bounds, iter_blocks
from .errors import client_closed, deadline_exceeded, device_out_of_memory, non_finite_accumulated, non_finite_block
from .limits import admit
from .objectives import OBJECTIVES
from .request import GradientRequest
from .settings import Settings

TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64}


class Deadline:
    """Checked between blocks; past it, or once the client has gone, the request stops and
    frees its tensors.

    `started`: time.monotonic() at the request's arrival (default now), so that time spent
    reading the body and waiting for the compute slot counts. `cancelled`: asks whether the
    client has gone (the HTTP layer peeks at the connection); polled at most every
    CANCEL_POLL_S, so that tiny blocks do not each cost a system call.
    """
    CANCEL_POLL_S = 0.02

    def __init__(self, timeout_s: float, started: float | None = None,
                 cancelled: Callable[[], bool] | None = None):
        self.timeout_s = timeout_s
        self.expires = (time.monotonic() if started is None else started) + timeout_s
        self.cancelled = cancelled
        self.next_poll = 0.0

    def remaining(self) -> float:
        return self.expires - time.monotonic()

    def check(self) -> None:
        now = time.monotonic()
        if now > self.expires:
            raise deadline_exceeded(self.timeout_s)
        if self.cancelled is not None and now >= self.next_poll:
            self.next_poll = now + self.CANCEL_POLL_S
            if self.cancelled():
                raise client_closed()


@contextmanager
def device_memory_guard() -> Iterator[None]:
    """Out of device memory: free what the request held, then a domain error."""
    try:
        yield
    except torch.OutOfMemoryError as exc:  # torch.cuda.OutOfMemoryError is the same class
        release_device_memory(exc)
        raise device_out_of_memory() from None


def load_vectors(req: GradientRequest, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(req.vectors, dtype=TORCH_DTYPES[req.dtype], device=device)  # (N, D)


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

    def blocks(self) -> Iterator[Block]:
        """Every block, row-block-major: kept, or recomputed as consumed; the deadline holds."""
        req = self.request
        with device_memory_guard():
            source = self.kept if self.kept is not None else iter_blocks(
                self.vectors, req.factor, OBJECTIVES[req.objective], req.offset)
            for block in source:
                yield block
                self.deadline.check()


def run(req: GradientRequest, settings: Settings, deadline: Deadline | None = None) -> Result:
    """Admit (limit_exceeded before any tensor), then compute on this worker's device."""
    admit(req.n, req.dim, req.factor, req.outputs, settings)
    device = resolve_device(settings.device)
    deadline = deadline or Deadline(settings.request_timeout_s)
    with device_memory_guard():
        vectors = load_vectors(req, device)  # (N, D)
        keep_bytes = settings.max_block_elements * vectors.element_size()
        return summarize(req, device, vectors, deadline, keep_bytes)


def summarize(req: GradientRequest, device: torch.device, vectors: torch.Tensor, deadline: Deadline,
              keep_bytes: int) -> Result:
    """Pass one: losses (F, F) and accumulated (N, D); non_finite_result if anything is not finite."""
    f = req.factor
    keep, kept, kept_bytes = "blocks" in req.outputs, [], 0
    losses = torch.empty((f, f), dtype=vectors.dtype, device=device)  # (F, F)
    # True proves the block finite: a sum is finite only if all its terms are, and the row
    # and column sums cover every gradient entry. This saves a pass over each gradient;
    # False may also be an overflowing sum, so those blocks are rechecked exactly below.
    surely_finite = torch.empty((f, f), dtype=torch.bool, device=device)  # (F, F), no per-block sync
    accumulated = torch.zeros_like(vectors)  # (N, D)
    for block in iter_blocks(vectors, f, OBJECTIVES[req.objective], req.offset):
        row_sums, col_sums = add_to_vectors(accumulated, block)  # (h, D), (w, D)
        losses[block.r, block.c] = block.loss
        surely_finite[block.r, block.c] = (
            torch.isfinite(block.loss) & torch.isfinite(row_sums).all() & torch.isfinite(col_sums).all())
        if keep:
            kept.append(block)
            kept_bytes += block.gradient.untyped_storage().nbytes()
            keep = kept_bytes <= keep_bytes  # over budget: let them go, blocks() recomputes
        deadline.check()
    if not bool(surely_finite.all()):
        first = first_non_finite_block(vectors, req, surely_finite)
        if first is not None:
            raise non_finite_block(*first, req.dtype)
    if not bool(torch.isfinite(accumulated).all()):
        raise non_finite_accumulated(req.dtype)
    return Result(req, device, block_bounds(req.n, f), losses, accumulated, vectors, deadline,
                  kept if keep else None)


def first_non_finite_block(vectors: torch.Tensor, req: GradientRequest,
                           surely_finite: torch.Tensor) -> tuple[int, int] | None:
    """Row-block-major, the first block whose loss or gradient is not finite, checked entry by entry."""
    bounds = block_bounds(req.n, req.factor)
    for r, c in torch.nonzero(~surely_finite).tolist():  # row-major order
        block = block_at(vectors, bounds, r, c, OBJECTIVES[req.objective], req.offset)
        if not (bool(torch.isfinite(block.loss)) and bool(torch.isfinite(block.gradient).all())):
            return r, c
    return None  # only sums overflowed: the accumulated check reports it
