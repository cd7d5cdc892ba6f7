"""Per-block gradients of a pairwise feature matrix: the numeric core.

V has shape (N, D). The pair matrix M[i, j] = concat(V[i], V[j]) has shape
(N, N, 2D) and is never built whole: each block is built on its own, detached
as its own autograd leaf, and differentiated alone, so that no graph is
backwarded twice and no gradient leaks from one block into another. The
accumulated gradient on V is the chain rule from each block's gradient back to
the rows and columns it came from, which equals calling
backward(retain_graph=True) once per block on one shared graph.
Blocks are ordered row-block-major: r outer, c inner.

Pure module: tensors and ints in, tensors out. No Flask, no JSON.
"""
from dataclasses import dataclass
from typing import Iterator

import torch

from .objectives import Objective

def block_bounds(n: int, factor: int) -> list[int]:
    """F + 1 boundaries; the last block takes the remainder."""
    base = n // factor
    return [k * base for k in range(factor)] + [n]


def largest_block_side(n: int, factor: int) -> int:
    base = n // factor
    return max(base, n - (factor - 1) * base)


@dataclass(frozen=True)
class Block:
    r: int  # row-block index, 0..F-1
    c: int  # column-block index
    row_span: tuple[int, int]  # [start, stop) of its rows in V
    col_span: tuple[int, int]  # [start, stop) of its columns in V
    loss: torch.Tensor  # 0-d
    gradient: torch.Tensor  # (rows, cols, 2D), dL/dblock


def pair_block(vectors: torch.Tensor, row_span: tuple[int, int], col_span: tuple[int, int]) -> torch.Tensor:
    """M[rows, cols] built directly from V, without the rest of M."""
    row_vecs = vectors[row_span[0]:row_span[1]]  # (h, D)
    col_vecs = vectors[col_span[0]:col_span[1]]  # (w, D)
    h, w, d = row_vecs.shape[0], col_vecs.shape[0], vectors.shape[1]
    return torch.cat(
        (row_vecs[:, None, :].expand(h, w, d),  # (h, w, D): V[i]
         col_vecs[None, :, :].expand(h, w, d)),  # (h, w, D): V[j]
        dim=-1,
    )  # (h, w, 2D)


def block_gradient(block: torch.Tensor, objective: Objective, offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss and dL/dblock with the block detached as a leaf of its own graph."""
    leaf = block.detach().requires_grad_(True)  # (h, w, 2D)
    with torch.enable_grad():
        loss = objective(leaf, offset)  # ()
        (grad,) = torch.autograd.grad(loss, leaf)  # (h, w, 2D)
    return loss.detach(), grad


def block_at(vectors: torch.Tensor, bounds: list[int], r: int, c: int,
             objective: Objective, offset: float) -> Block:
    """Block (r, c): its loss and gradient, computed alone."""
    row_span, col_span = (bounds[r], bounds[r + 1]), (bounds[c], bounds[c + 1])
    loss, grad = block_gradient(pair_block(vectors, row_span, col_span), objective, offset)
    return Block(r, c, row_span, col_span, loss, grad)


def iter_blocks(vectors: torch.Tensor, factor: int, objective: Objective, offset: float) -> Iterator[Block]:
    """Every block's loss and gradient, row-block-major.

    One block at a time: computing equal-shaped blocks together (batched) was
    measured no faster on CPU, as the work is elementwise, not per-call overhead.
    """
    bounds = block_bounds(vectors.shape[0], factor)
    for r in range(factor):
        for c in range(factor):
            yield block_at(vectors, bounds, r, c, objective, offset)


def chain_rule_sums(block: Block) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's share of dL/dV: entry (i, j) holds V[i] in its first D and V[j] in its last D."""
    d = block.gradient.shape[2] // 2
    row_sums = block.gradient[:, :, :d].sum(dim=1)  # (h, D), onto V[rows]
    col_sums = block.gradient[:, :, d:].sum(dim=0)  # (w, D), onto V[cols]
    return row_sums, col_sums


def add_to_vectors(accumulated: torch.Tensor, block: Block) -> tuple[torch.Tensor, torch.Tensor]:
    """Chain rule from one block back to the rows and columns it came from; returns the
    row and column sums it added."""
    row_sums, col_sums = chain_rule_sums(block)
    accumulated[block.row_span[0]:block.row_span[1]] += row_sums  # (h, D)
    accumulated[block.col_span[0]:block.col_span[1]] += col_sums  # (w, D)
    return row_sums, col_sums
