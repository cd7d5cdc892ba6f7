"""Per-block gradients of a pairwise feature matrix: the numeric core.

V has shape (N, D). The pair matrix M[i, j] = concat(V[i], V[j]) has shape
(N, N, 2D) and is never built whole. It is cut into F x F blocks, the last row
and column of blocks taking the remainder, so there are at most four block
shapes: base x base, base x last, last x base, last x last.

Blocks of equal shape are computed together, a chunk at a time: a chunk is a
stack (k, h, w, 2D) of whole blocks holding at most `max_elements` numbers
(1M, 256K when chunks may run on several lanes, or BLOCKGRAD_MAX_BLOCK_ELEMENTS,
the memory of the largest block a request may have, if that is less; always at
least one block). The stack is detached as one autograd leaf,
the objective gives one loss per block (k,), and the gradient of their sum is
taken with respect to the leaf.

Why this is each block differentiated on its own: block i's loss is a function
of stack[i] alone (objectives take any max-shift or scale per block), so
d(sum_j L_j)/d stack[i] = dL_i/d stack[i] + sum_{j != i} dL_j/d stack[i]
= dL_i/d stack[i] + 0. The slice i of the leaf's gradient is therefore exactly
the gradient a leaf holding block i alone would get, and no gradient reaches V
or another block: no graph is shared with V, nothing is backwarded twice. On
CPU with one torch thread (a worker's) the block gradients and losses are the
same bits as one block at a time, and for sum, mean and sum_of_squares the
gradients are the literal seed loops' bits (tests/test_batched_engine.py; with
several threads torch may split one large reduction, changing a loss's last bit).
Batching pays because the cost of a small block is Python and autograd dispatch,
not arithmetic (docs/benchmarks.md).

The accumulated gradient on V is the chain rule from each block's gradient
back to the rows and columns it came from, which equals calling
backward(retain_graph=True) once per block on one shared graph; summed a chunk
at a time, it differs from that only in the order of the additions.

Blocks are streamed row-block-major (r outer, c inner): `plan_bands`, the one
plan (of the whole matrix for a request, of a tile for a job's task), puts the
chunks in bands of whole block rows, so a band's chunks hold every block of its
rows and are taken apart in that order. Memory is bounded by a chunk, not by N.

Pure module: tensors and ints in, tensors out. No Flask, no JSON.
"""
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .objectives import Objective

# Numbers per chunk when blocks are smaller: small enough that a chunk's tensors stay in
# cache (docs/benchmarks.md). A chunk always holds one whole block, so blocks up to
# BLOCKGRAD_MAX_BLOCK_ELEMENTS still go one per chunk.
DEFAULT_CHUNK_ELEMENTS = 1024 * 1024
# Numbers per chunk when a request's chunks may run on several lanes: two lanes' working
# sets then fit the shared cache together (docs/cores.md, "Chunk size").
PARALLEL_CHUNK_ELEMENTS = 256 * 1024


def block_bounds(n: int, factor: int) -> list[int]:
    """F + 1 boundaries; the last block takes the remainder."""
    base = n // factor
    return [k * base for k in range(factor)] + [n]


@dataclass(frozen=True)
class Block:
    r: int  # row-block index, 0..F-1
    c: int  # column-block index
    row_span: tuple[int, int]  # [start, stop) of its rows in V
    col_span: tuple[int, int]  # [start, stop) of its columns in V
    loss: torch.Tensor  # 0-d
    gradient: torch.Tensor  # (rows, cols, 2D), dL/dblock


@dataclass(frozen=True)
class Chunk:
    """Blocks rows x cols (block indices, consecutive), all of shape height x width."""
    rows: range
    cols: range
    height: int
    width: int
    base: int  # rows of every block but the last: block r starts at row r * base

    @property
    def count(self) -> int:
        return len(self.rows) * len(self.cols)


@dataclass(frozen=True)
class ChunkResult:
    chunk: Chunk
    losses: torch.Tensor  # (kr, kc)
    gradient: torch.Tensor  # (kr, kc, h, w, 2D)


def shape_groups(n: int, factor: int) -> list[tuple[range, int]]:
    """Block indices of equal side: [(indices, side)], one group when the last block is not larger."""
    base = n // factor
    last = n - (factor - 1) * base
    return [(range(factor), base)] if last == base else [(range(factor - 1), base), (range(factor - 1, factor), last)]


def split(indices: range, size: int) -> list[range]:
    return [indices[k:k + size] for k in range(0, len(indices), size)]


def overlap(a: range, b: range) -> range:
    return range(max(a.start, b.start), min(a.stop, b.stop))


def plan_bands(n: int, dim: int, factor: int, max_elements: int,
               rows: range | None = None, cols: range | None = None) -> Iterator[list[Chunk]]:
    """The one plan of a computation: the blocks rows x cols (all of them by default; a job's
    tile otherwise) in chunks of one block shape and at most max_elements numbers (at least
    one block each), grouped in bands of whole block rows, row-block-major. A band's chunks
    partition its rows' blocks by column, left to right; several block rows share a band
    when a whole row of the blocks fits, else each chunk is a run of one row's blocks and a
    band of its own. Lazy: a request of 1 x 1 blocks may plan thousands of chunks."""
    base, pair, groups = n // factor, 2 * dim, shape_groups(n, factor)
    columns = [(part, width) for group, width in groups if (part := overlap(group, cols or group))]
    row_width = sum(len(group) * width for group, width in columns)  # columns of V in one row of blocks
    for row_group, height in groups:
        if not (row_group := overlap(row_group, rows or row_group)):
            continue
        row_numbers = height * row_width * pair  # one whole row of the blocks
        if row_numbers <= max_elements:
            for band in split(row_group, max_elements // row_numbers):
                yield [Chunk(band, group, height, width, base) for group, width in columns]
            continue
        for r in row_group:
            for group, width in columns:
                per_chunk = max(1, max_elements // (height * width * pair))
                for run in split(group, per_chunk):
                    yield [Chunk(range(r, r + 1), run, height, width, base)]


def elements_per_chunk(max_elements: int, objective: Objective, dim: int, element_size: int,
                       parallel: bool = False) -> int:
    """Numbers per chunk: DEFAULT_CHUNK_ELEMENTS (PARALLEL_CHUNK_ELEMENTS when chunks may run
    side by side), at most max_elements (the memory of the largest allowed block), less for
    an objective that declares `bytes_per_pair` of activations, so that pairs plus
    activations take about that memory. A chunk always holds one block, whatever this returns."""
    extra = getattr(objective, "bytes_per_pair", 0) or 0
    pair_bytes = 2 * dim * element_size
    numbers = max(1, min(max_elements, DEFAULT_CHUNK_ELEMENTS) * pair_bytes // (pair_bytes + extra))
    return min(numbers, PARALLEL_CHUNK_ELEMENTS) if parallel else numbers


def pair_blocks(vectors: torch.Tensor, chunk: Chunk) -> torch.Tensor:
    """The chunk's blocks of M built directly from V, without the rest of M: (kr, kc, h, w, 2D)."""
    kr, kc, h, w, d = len(chunk.rows), len(chunk.cols), chunk.height, chunk.width, vectors.shape[1]
    row_start, col_start = chunk.rows.start * chunk.base, chunk.cols.start * chunk.base
    row_vecs = vectors[row_start:row_start + kr * h].reshape(kr, h, d)  # (kr, h, D)
    col_vecs = vectors[col_start:col_start + kc * w].reshape(kc, w, d)  # (kc, w, D)
    return torch.cat(
        (row_vecs[:, None, :, None, :].expand(kr, kc, h, w, d),  # V[i]
         col_vecs[None, :, None, :, :].expand(kr, kc, h, w, d)),  # V[j]
        dim=-1,
    )  # (kr, kc, h, w, 2D)


def chunk_gradients(vectors: torch.Tensor, chunk: Chunk, objective: Objective, offset: float) -> ChunkResult:
    """Every block of the chunk: loss and dL/dblock, the stack detached as one leaf (see the
    module docstring for why each block's gradient is its own)."""
    pairs = pair_blocks(vectors, chunk)  # (kr, kc, h, w, 2D)
    kr, kc = pairs.shape[:2]
    leaf = pairs.reshape(kr * kc, *pairs.shape[2:]).detach().requires_grad_(True)  # (k, h, w, 2D)
    with torch.enable_grad():
        losses = objective.losses(leaf, offset)  # (k,)
        (grad,) = torch.autograd.grad(losses.sum(), leaf)  # (k, h, w, 2D)
    return ChunkResult(chunk, losses.detach().reshape(kr, kc), grad.reshape(pairs.shape))


def band_blocks(results: list[ChunkResult]) -> Iterator[Block]:
    """A band's chunk results taken apart into blocks, row-block-major."""
    # unbind makes every block's views in one call, not one indexing call per block.
    parts = [(result.chunk, result.losses.unbind(0), result.gradient.unbind(0)) for result in results]
    for i, r in enumerate(results[0].chunk.rows):
        for chunk, losses, gradients in parts:
            row_start = r * chunk.base
            for c, loss, gradient in zip(chunk.cols, losses[i].unbind(0), gradients[i].unbind(0)):
                col_start = c * chunk.base
                yield Block(r, c, (row_start, row_start + chunk.height), (col_start, col_start + chunk.width),
                            loss, gradient)


@dataclass(frozen=True)
class ChunkSums:
    """A chunk's share of dL/dV: entry (i, j) of a block holds V[i] in its first D and V[j]
    in its last D, so its gradient goes back to row i and to row j of V."""
    rows: torch.Tensor  # (kr * h, D): onto the chunk's rows of V, summed over its blocks' columns
    cols: torch.Tensor  # (kc * w, D): onto its columns of V, summed over its blocks' rows


def chain_rule_sums(result: ChunkResult) -> ChunkSums:
    kr, kc, h, w, pair = result.gradient.shape
    d = pair // 2
    return ChunkSums(result.gradient[..., :d].sum(dim=(1, 3)).reshape(kr * h, d),  # (kr * h, D)
                     result.gradient[..., d:].sum(dim=(0, 2)).reshape(kc * w, d))  # (kc * w, D)


def add_to_vectors(rows_into: torch.Tensor, cols_into: torch.Tensor, chunk: Chunk, sums: ChunkSums,
                   origin: tuple[int, int] = (0, 0)) -> None:
    """The chain rule's scatter: a chunk's sums added onto the rows and columns of V they came
    from (a chunk's block rows and columns are consecutive in V). rows_into starts at the
    first row of block row origin[0], cols_into at that of block column origin[1]: both the
    (N, D) dL/dV for a request, a job tile's own (rows, D) and (cols, D) shares for a task."""
    row_start, col_start = (chunk.rows.start - origin[0]) * chunk.base, (chunk.cols.start - origin[1]) * chunk.base
    rows_into[row_start:row_start + sums.rows.shape[0]] += sums.rows  # (kr * h, D)
    cols_into[col_start:col_start + sums.cols.shape[0]] += sums.cols  # (kc * w, D)
