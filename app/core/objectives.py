"""The fixed registry of block objectives: name -> L(block, offset).

Each objective maps one block B of shape (rows, cols, 2D) to a 0-d tensor.
User input only ever selects a name from this table; nothing is evaluated.
"""
from typing import Callable

import torch

Objective = Callable[[torch.Tensor, float], torch.Tensor]


def block_sum(block: torch.Tensor, offset: float) -> torch.Tensor:
    return torch.sum(block + offset)  # sum(i + 5) of the per-block loop this service replaces


def block_mean(block: torch.Tensor, offset: float) -> torch.Tensor:
    return torch.mean(block)


def block_sum_of_squares(block: torch.Tensor, offset: float) -> torch.Tensor:
    return torch.sum(block * block)


def largest_magnitude(block: torch.Tensor) -> torch.Tensor:
    """max |B| as a constant (no gradient), 1 where B is all zeros."""
    scale = block.detach().abs().amax()  # ()
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def block_l2_norm(block: torch.Tensor, offset: float) -> torch.Tensor:
    # Scaled by max |B| so that squares neither underflow (1e-23 in float32) nor overflow;
    # vector_norm's backward is 0 (not NaN) where the norm is 0.
    scale = largest_magnitude(block)  # ()
    return scale * torch.linalg.vector_norm(block / scale)


def block_logsumexp(block: torch.Tensor, offset: float) -> torch.Tensor:
    # Shifted by a constant max: the gradient is exp(B - m) / sum(exp(B - m)) computed
    # directly, not exp(B - L), which loses every digit once L is large (1e8 in float32).
    shift = block.detach().amax()  # ()
    return shift + torch.log(torch.sum(torch.exp(block - shift)))


OBJECTIVES: dict[str, Objective] = {
    "sum": block_sum,
    "mean": block_mean,
    "sum_of_squares": block_sum_of_squares,
    "l2_norm": block_l2_norm,
    "logsumexp": block_logsumexp,
}
DEFAULT_OBJECTIVE = "sum"
DEFAULT_OFFSET = 5.0
