"""Run the engine for one request: deadline, finiteness, and the two passes.

Pass one computes the losses and the accumulated gradient block by block and
checks every block is finite, so that an error is known before the first byte
of a 200 is sent. Pass two, only when blocks are asked for, recomputes each
block's gradient while the response streams it (the engine is cheap next to
JSON; holding every block would cost N x N x 2D numbers of memory).
"""
import math
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from .device import release_device_memory
from .engine import Block, add_to_vectors, block_bounds, iter_blocks
from .errors import ApiError, DeadlineExceeded
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


def load_vectors(req: GradientRequest, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(req.vectors, dtype=TORCH_DTYPES[req.dtype], device=device)  # (N, D)


def blocks(vectors: torch.Tensor, req: GradientRequest, deadline: Deadline) -> Iterator[Block]:
    try:
        for block in iter_blocks(vectors, req.factor, OBJECTIVES[req.objective], req.offset):
            yield block
            deadline.check()
    except torch.OutOfMemoryError as exc:
        # Mid-stream nobody turns this into a 503; free the cache here as well.
        release_device_memory(exc)
        raise


def summarize(vectors: torch.Tensor, req: GradientRequest, deadline: Deadline,
              on_block: Callable[[Block], None] | None = None) -> Summary:
    """Pass one: losses (F, F) and accumulated (N, D); 422 if anything is not finite.

    `on_block` sees every block as it is computed (/v2 writes the gradients into
    one preallocated grid instead of computing them again in a second pass)."""
    f = req.factor
    losses = torch.empty((f, f), dtype=vectors.dtype, device=vectors.device)  # (F, F)
    finite = torch.empty((f, f), dtype=torch.bool, device=vectors.device)  # (F, F), no per-block sync
    accumulated = torch.zeros_like(vectors)  # (N, D)
    for block in blocks(vectors, req, deadline):
        losses[block.row, block.col] = block.loss
        finite[block.row, block.col] = torch.isfinite(block.loss) & torch.isfinite(block.gradient).all()
        add_to_vectors(accumulated, block)
        if on_block is not None:
            on_block(block)
    if not bool(finite.all()):
        r, c = (int(k) for k in torch.nonzero(~finite)[0])
        raise ApiError(422, "non_finite_result",
                       f"Block (row {r}, col {c}) has a loss or gradient that is not finite in {req.dtype}; "
                       "send smaller values, another objective, or dtype float64.",
                       {"block": {"row": r, "col": c}})
    if not bool(torch.isfinite(accumulated).all()):
        raise ApiError(422, "non_finite_result",
                       f"The accumulated gradient is not finite in {req.dtype}; "
                       "send smaller values, another objective, or dtype float64.",
                       {"output": "accumulated"})
    return Summary(block_bounds(req.n, f), losses, accumulated)
