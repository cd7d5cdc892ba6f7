"""Run the engine for one request: deadline, finiteness, and the two passes.

Pass one computes the losses and the accumulated gradient block by block and
checks every block is finite, so that an error is known before the first byte
of a 200 is sent. Pass two, only when blocks are asked for, recomputes each
block's gradient while the response streams it (the engine is cheap next to
JSON; holding every block would cost N x N x 2D numbers of memory). While the
blocks' gradients together hold no more memory than one block may (autograd
often returns a view of one number, e.g. for `sum`), pass one keeps them and
pass two is skipped.
"""
import math
import time
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Callable, Iterable, Iterator

import torch

from .device import release_device_memory, resolve_device
from .engine import Block, block_at, block_bounds, chain_rule_sums, iter_blocks
from .errors import ApiError, DeadlineExceeded
from .limits import admit
from .objectives import OBJECTIVES
from .schemas import GradientRequest

TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64}


class Deadline:
    """Checked between blocks; past it the request stops and frees its tensors."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.expires = time.monotonic() + timeout_s

    def check(self) -> None:
        if time.monotonic() > self.expires:
            raise DeadlineExceeded(self.timeout_s, retry_after_s=max(1, math.ceil(self.timeout_s / 10)))


@dataclass(frozen=True)
class Summary:
    bounds: list[int]
    losses: torch.Tensor  # (F, F)
    accumulated: torch.Tensor  # (N, D)
    kept: list[Block] | None = None  # every block, row-block-major, when they fit `keep_bytes`


def load_vectors(req: GradientRequest, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(req.vectors, dtype=TORCH_DTYPES[req.dtype], device=device)  # (N, D)


def start(req: GradientRequest, config: Mapping) -> tuple[torch.device, Deadline, torch.Tensor]:
    """What every route does first: admit (413 before any tensor), then the worker's device,
    the request's deadline, and the vectors on that device."""
    admit(req.n, req.dim, req.factor, req.outputs, config)
    device = resolve_device(config["BLOCKGRAD_DEVICE"])
    deadline = Deadline(config["BLOCKGRAD_REQUEST_TIMEOUT_S"])
    return device, deadline, load_vectors(req, device)  # (N, D)


def checked(items: Iterable[Block], deadline: Deadline) -> Iterator[Block]:
    """Yield each block, then check the deadline: past it, the request stops there."""
    for block in items:
        yield block
        deadline.check()


def blocks(vectors: torch.Tensor, req: GradientRequest, deadline: Deadline) -> Iterator[Block]:
    try:
        yield from checked(iter_blocks(vectors, req.factor, OBJECTIVES[req.objective], req.offset), deadline)
    except torch.OutOfMemoryError as exc:
        # Mid-stream nobody turns this into a 503; free the cache here as well.
        release_device_memory(exc)
        raise


def summarize(vectors: torch.Tensor, req: GradientRequest, deadline: Deadline,
              on_block: Callable[[Block], None] | None = None, keep_bytes: int = 0) -> Summary:
    """Pass one: losses (F, F) and accumulated (N, D); 422 if anything is not finite.

    `on_block` sees every block as it is computed (/v2 writes the gradients into
    one preallocated grid instead of computing them again in a second pass).
    Blocks asked for are kept while their gradients' storage stays within
    `keep_bytes` in all, so that pass two need not recompute them.
    """
    f = req.factor
    keep, kept, kept_bytes = "blocks" in req.outputs, [], 0
    losses = torch.empty((f, f), dtype=vectors.dtype, device=vectors.device)  # (F, F)
    # True proves the block finite: a sum is finite only if all its terms are, and the row
    # and column sums cover every gradient entry. This saves a pass over each gradient;
    # False may also be an overflowing sum, so those blocks are rechecked exactly below.
    surely_finite = torch.empty((f, f), dtype=torch.bool, device=vectors.device)  # (F, F), no per-block sync
    accumulated = torch.zeros_like(vectors)  # (N, D)
    for block in blocks(vectors, req, deadline):
        row_sums, col_sums = chain_rule_sums(block)  # (h, D), (w, D)
        losses[block.row, block.col] = block.loss
        surely_finite[block.row, block.col] = (
            torch.isfinite(block.loss) & torch.isfinite(row_sums).all() & torch.isfinite(col_sums).all())
        accumulated[block.rows[0]:block.rows[1]] += row_sums
        accumulated[block.cols[0]:block.cols[1]] += col_sums
        if on_block is not None:
            on_block(block)
        if keep:
            kept.append(block)
            kept_bytes += block.gradient.untyped_storage().nbytes()
            if kept_bytes > keep_bytes:  # over budget: let them go, pass two recomputes
                keep, kept = False, []
    if not bool(surely_finite.all()):
        first = first_non_finite_block(vectors, req, surely_finite)
        if first is not None:
            r, c = first
            raise ApiError(422, "non_finite_result",
                           f"Block (row {r}, col {c}) has a loss or gradient that is not finite in {req.dtype}; "
                           f"{non_finite_advice(req.dtype)}.",
                           {"block": {"row": r, "col": c}})
    if not bool(torch.isfinite(accumulated).all()):
        raise ApiError(422, "non_finite_result",
                       f"The accumulated gradient is not finite in {req.dtype}; {non_finite_advice(req.dtype)}.",
                       {"output": "accumulated"})
    return Summary(block_bounds(req.n, f), losses, accumulated, kept if keep else None)


def non_finite_advice(dtype: str) -> str:
    """What to change; float64 is worth suggesting only to a float32 request."""
    if dtype == "float32":
        return "send smaller values, another objective, or dtype float64"
    return "send smaller values or another objective"


def first_non_finite_block(vectors: torch.Tensor, req: GradientRequest,
                           surely_finite: torch.Tensor) -> tuple[int, int] | None:
    """Row-block-major, the first block whose loss or gradient is not finite, checked entry by entry."""
    bounds = block_bounds(req.n, req.factor)
    for r, c in torch.nonzero(~surely_finite).tolist():  # row-major order
        block = block_at(vectors, bounds, r, c, OBJECTIVES[req.objective], req.offset)
        if not (bool(torch.isfinite(block.loss)) and bool(torch.isfinite(block.gradient).all())):
            return r, c
    return None  # only sums overflowed: the accumulated check reports it
