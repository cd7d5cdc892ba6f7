"""The built-in block objectives: name -> Objective.

An objective maps a stack of equal-shaped blocks (k, h, w, 2D) to one loss per
block (k,), differentiably, each block's loss depending on its own block only
(any max-shift or scale is taken per block). The engine differentiates the sum
of these losses, so each block's gradient is exactly its own (app/core/engine.py).
User input only ever selects a name from this table; nothing is evaluated.

`served_objectives` is this server's table: the built-ins, then the models of
BLOCKGRAD_MODEL_DIR (models.py). Built once per app (create_app) and passed explicitly to
`build_request`; the request then carries the resolved objective, so `run` needs no lookup.
"""
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from .dtypes import DTYPES
from .models import ModelObjective, load_models
from .settings import Settings

BLOCK_DIMS = (1, 2, 3)  # the dimensions of one block in a (k, h, w, 2D) stack


class Objective(Protocol):
    """What the engine needs of an objective. A model-backed objective also exposes `dim` and
    `dtypes` (the D and dtypes it takes; a built-in takes any) and `bytes_per_pair`
    (activation memory per pair), which the engine uses to size its chunks."""
    name: str
    description: str

    def losses(self, blocks: torch.Tensor, offset: float) -> torch.Tensor:
        """(k, h, w, 2D) -> (k,), block i's loss a function of blocks[i] alone."""


@dataclass(frozen=True)
class BuiltinObjective:
    name: str
    description: str
    losses: Callable[[torch.Tensor, float], torch.Tensor]  # (k, h, w, 2D) blocks, offset -> (k,) losses


def per_block(values: torch.Tensor) -> torch.Tensor:
    """(k,) -> (k, 1, 1, 1): a per-block constant broadcast over its block."""
    return values[:, None, None, None]


def power_of_two_scale(blocks: torch.Tensor) -> torch.Tensor:
    """(k,) the largest power of two <= max |B| per block (0.5 for an all-zero block).
    Dividing by it is exact, so sums of B / s are sums of B scaled exactly, without
    overflow (|B / s| < 2) and without the underflow of the smallest values."""
    _, exponent = torch.frexp(blocks.detach().abs().amax(dim=BLOCK_DIMS))  # max = m * 2^e, m in [0.5, 1)
    return torch.ldexp(torch.ones_like(exponent, dtype=blocks.dtype), exponent - 1)  # (k,), finite


class ScaledMean(torch.autograd.Function):
    """mean(B) per block as s * (sum(B / s) / count): the same number as sum(B) / count
    wherever that sum is finite, and still right where it would overflow (all entries near
    the dtype's maximum). The gradient is 1 / count, given directly."""

    @staticmethod
    def forward(ctx, blocks: torch.Tensor) -> torch.Tensor:
        scale = power_of_two_scale(blocks)  # (k,)
        ctx.shape, ctx.count = blocks.shape, blocks[0].numel()
        return scale * (torch.sum(blocks / per_block(scale), dim=BLOCK_DIMS) / ctx.count)  # (k,)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> torch.Tensor:
        return per_block(grad_out / ctx.count).expand(ctx.shape)  # (k, h, w, 2D), a view of k numbers


class ScaledSumOfSquares(torch.autograd.Function):
    """sum(B * B) per block as s^2 * sum((B / s)^2): the same number as the plain sum where
    no square under- or overflows, and right where the squares of small entries would
    underflow (1e-23 in float32) although their sum does not. The gradient 2B, directly."""

    @staticmethod
    def forward(ctx, blocks: torch.Tensor) -> torch.Tensor:
        scale = power_of_two_scale(blocks)  # (k,)
        unit = blocks / per_block(scale)  # (k, h, w, 2D), exact
        total = torch.sum(unit * unit, dim=BLOCK_DIMS)  # (k,), in [1, count] unless the block is 0
        ctx.save_for_backward(blocks)
        square = scale * scale  # (k,), exact where representable: then one rounding, as the plain sum
        exact = torch.isfinite(square) & (square >= torch.finfo(blocks.dtype).tiny)
        return torch.where(exact, total * square, (total * scale) * scale)  # (k,)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> torch.Tensor:
        (blocks,) = ctx.saved_tensors
        return blocks * per_block(2 * grad_out)  # (k, h, w, 2D): 2B exactly, one pass


class ScaledNorm(torch.autograd.Function):
    """||B||_2 per block, computed on B / max|B| so that squares neither underflow nor
    overflow, with the gradient B / ||B|| = u / ||u|| (u = B / max|B|) taken directly.

    Autograd through `scale * norm(B / scale)` would form `scale * u / ||u||` and then
    divide by `scale`: for subnormal blocks (1e-45 in float32, 1e-320 in float64) the
    product underflows and the gradient comes out 0 or off by a whole factor.
    """

    @staticmethod
    def forward(ctx, blocks: torch.Tensor) -> torch.Tensor:
        largest = blocks.detach().abs().amax(dim=BLOCK_DIMS)  # (k,) max |B| per block, a constant
        scale = torch.where(largest > 0, largest, torch.ones_like(largest))  # 1 where a block is all zeros
        unit = blocks / per_block(scale)  # (k, h, w, 2D), |u| <= 1
        norms = torch.linalg.vector_norm(unit, dim=BLOCK_DIMS)  # (k,), >= 1 unless the block is 0
        ctx.save_for_backward(unit, norms)
        return scale * norms  # (k,)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> torch.Tensor:
        unit, norms = ctx.saved_tensors
        # 0 (not NaN) where the norm is 0, as torch.linalg.vector_norm's own backward.
        safe = torch.where(norms > 0, norms, torch.ones_like(norms))  # (k,)
        return unit * per_block(grad_out / safe)  # (k, h, w, 2D)


def stacked_logsumexp(blocks: torch.Tensor, offset: float) -> torch.Tensor:
    # Shifted by a constant max per block: the gradient is exp(B - m) / sum(exp(B - m)) computed
    # directly, not exp(B - L), which loses every digit once L is large (1e8 in float32).
    shift = blocks.detach().amax(dim=BLOCK_DIMS)  # (k,)
    return shift + torch.log(torch.sum(torch.exp(blocks - per_block(shift)), dim=BLOCK_DIMS))  # (k,)


OBJECTIVES: dict[str, Objective] = {objective.name: objective for objective in (
    # sum(i + 5) of the per-block loop, over a stack of blocks at once
    BuiltinObjective("sum", "sum(B + offset), offset default 5.0",
                     lambda blocks, offset: torch.sum(blocks + offset, dim=BLOCK_DIMS)),
    BuiltinObjective("mean", "mean(B)", lambda blocks, offset: ScaledMean.apply(blocks)),
    BuiltinObjective("sum_of_squares", "sum(B * B)", lambda blocks, offset: ScaledSumOfSquares.apply(blocks)),
    BuiltinObjective("l2_norm", "Euclidean norm of all of B (gradient 0 where the norm is 0)",
                     lambda blocks, offset: ScaledNorm.apply(blocks)),
    BuiltinObjective("logsumexp", "log(sum(exp(B))), computed max-shifted", stacked_logsumexp),
)}
DEFAULT_OBJECTIVE = "sum"
DEFAULT_OFFSET = 5.0


def served_objectives(settings: Settings) -> dict[str, Objective]:
    """Built-ins first, then models by name; raises ModelError for a file that cannot be served."""
    return {**OBJECTIVES, **load_models(settings.model_dir, OBJECTIVES)}


def describe(name: str, objective: Objective) -> dict[str, Any]:
    """One entry of GET /v1/objectives."""
    if isinstance(objective, ModelObjective):
        return {"name": name, "kind": "model", "dim": objective.dim, "dtypes": list(objective.dtypes),
                "description": objective.description, "file": objective.file.name, "size_bytes": objective.size_bytes,
                "parameters": objective.parameter_count, "bytes_per_pair": objective.bytes_per_pair}
    return {"name": name, "kind": "builtin", "dim": None, "dtypes": list(DTYPES), "description": objective.description}
