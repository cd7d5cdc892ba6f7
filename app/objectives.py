"""The fixed registry of block objectives: name -> L(block, offset).

Each objective maps one block B of shape (rows, cols, 2D) to a 0-d tensor.
User input only ever selects a name from this table; nothing is evaluated.
"""
from typing import Callable

import torch

Objective = Callable[[torch.Tensor, float], torch.Tensor]


def block_sum(block: torch.Tensor, offset: float) -> torch.Tensor:
    return torch.sum(block + offset)  # the seed's sum(i + 5)


def block_mean(block: torch.Tensor, offset: float) -> torch.Tensor:
    return torch.mean(block)


def block_sum_of_squares(block: torch.Tensor, offset: float) -> torch.Tensor:
    return torch.sum(block * block)


def block_l2_norm(block: torch.Tensor, offset: float) -> torch.Tensor:
    # vector_norm's backward is 0 (not NaN) where the norm is 0.
    return torch.linalg.vector_norm(block)


def block_logsumexp(block: torch.Tensor, offset: float) -> torch.Tensor:
    return torch.logsumexp(block.reshape(-1), dim=0)  # max-shifted, no overflow


OBJECTIVES: dict[str, Objective] = {
    "sum": block_sum,
    "mean": block_mean,
    "sum_of_squares": block_sum_of_squares,
    "l2_norm": block_l2_norm,
    "logsumexp": block_logsumexp,
}
DEFAULT_OBJECTIVE = "sum"
DEFAULT_OFFSET = 5.0
