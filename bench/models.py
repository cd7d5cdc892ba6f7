"""The model-scorer row's three ways to compute the same thing (issue 12), in this process:
the engine (`run`), the same model block by block in a plain loop, and the compute floor
(one forward and backward over all N x N pairs at once)."""
import os
import tempfile
from pathlib import Path

import torch

from app.core.device import resolve_device
from app.core.engine import block_bounds
from app.core.models import ModelObjective, load_models
from app.core.objectives import OBJECTIVES
from examples.export_scorer import export_scorer


def device() -> torch.device:
    """BLOCKGRAD_DEVICE (default cpu), so scripts/gpu_check.sh times the row on the GPU."""
    return resolve_device(os.environ.get("BLOCKGRAD_DEVICE", "cpu"))


def sync(where: torch.device) -> None:
    if where.type == "cuda":
        torch.cuda.synchronize(where)


def scorer(dim: int, hidden: int) -> ModelObjective:
    """The example's MLP scorer, exported and loaded (and checked) as the service loads it."""
    with tempfile.TemporaryDirectory() as tmp:
        export_scorer(Path(tmp) / "scorer.pt2", dim, hidden)
        return load_models(tmp, OBJECTIVES)["scorer"]


def pairs_of(rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    h, w, d = rows.shape[0], cols.shape[0], rows.shape[1]
    return torch.cat((rows[:, None, :].expand(h, w, d), cols[None, :, :].expand(h, w, d)), dim=-1)  # (h, w, 2D)


def block_loop(module, vectors: torch.Tensor, factor: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block by block in a plain loop: each block its own leaf, the model, autograd.grad, chain rule."""
    n, d = vectors.shape
    bounds = block_bounds(n, factor)
    accumulated = torch.zeros_like(vectors)  # (N, D)
    losses = torch.empty((factor, factor), dtype=vectors.dtype, device=vectors.device)  # (F, F)
    for r in range(factor):
        for c in range(factor):
            rows, cols = slice(bounds[r], bounds[r + 1]), slice(bounds[c], bounds[c + 1])
            leaf = pairs_of(vectors[rows], vectors[cols]).detach().requires_grad_(True)  # (h, w, 2D)
            with torch.enable_grad():
                loss = module(leaf.reshape(-1, 2 * d)).sum()  # ()
                (grad,) = torch.autograd.grad(loss, leaf)  # (h, w, 2D)
            accumulated[rows] += grad[:, :, :d].sum(dim=1)  # (h, D)
            accumulated[cols] += grad[:, :, d:].sum(dim=0)  # (w, D)
            losses[r, c] = loss.detach()
    sync(vectors.device)
    return accumulated, losses


def all_pairs_floor(module, vectors: torch.Tensor) -> torch.Tensor:
    """One forward and backward of the model over all N x N pairs at once: d sum(scores) / dV."""
    n, d = vectors.shape
    leaf = vectors.detach().requires_grad_(True)  # (N, D)
    with torch.enable_grad():
        scores = module(pairs_of(leaf, leaf).reshape(n * n, 2 * d))  # (N*N,)
        (grad,) = torch.autograd.grad(scores.sum(), leaf)  # (N, D)
    sync(vectors.device)
    return grad
