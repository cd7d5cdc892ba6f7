"""The batched engine (issue 10): the chunk plan, independence of stacked blocks, bit-for-bit
equality with one block at a time and with the literal seed loops, and Result.blocks()."""
import itertools

import numpy as np
import pytest
import torch

from app.core.engine import (Chunk, band_blocks, block_bounds, chunk_gradients, elements_per_chunk, pair_blocks,
                             plan_bands)
from app.core.objectives import OBJECTIVES
from app.core.request import GradientRequest, default_factor
from app.core.run import Deadline, load_vectors, pass_one

from tools.reference import reference_blocks

from .numeric import assert_matches

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def iter_blocks(vectors, factor, objective, offset, max_elements=1024 * 1024):
    """Every block as the run takes them: the plan's bands, each chunk computed, taken apart."""
    return [block for band in plan_bands(*vectors.shape, factor, max_elements)
            for block in band_blocks([chunk_gradients(vectors, chunk, objective, offset) for chunk in band])]


def block_numbers(chunk: Chunk, dim: int) -> int:
    return chunk.height * chunk.width * 2 * dim


@pytest.mark.parametrize("n,dim,factor,max_elements", [
    (37, 3, 7, 4 * 1024 * 1024), (37, 3, 7, 1), (37, 3, 7, 100), (37, 3, 30, 500), (10, 5, 2, 10 ** 9),
    (1, 4, 1, 1), (64, 2, 64, 300), (1000, 64, 334, 4 * 1024 * 1024), (4096, 64, 23, 4 * 1024 * 1024),
])
def test_plan_covers_every_block_once_row_block_major_within_the_chunk_limit(n, dim, factor, max_elements):
    bounds = block_bounds(n, factor)
    bands = plan_bands(n, dim, factor, max_elements)
    order = []
    shapes = set()
    for band in bands:
        rows = band[0].rows
        assert all(chunk.rows == rows for chunk in band)  # a band: whole block rows ...
        cols = [c for chunk in band for c in chunk.cols]
        assert cols == sorted(cols) and len(set(cols)) == len(cols)  # ... its chunks left to right
        # Memory: a band holds at most max_elements numbers, or one block when a block is larger.
        band_numbers = sum(chunk.count * block_numbers(chunk, dim) for chunk in band)
        assert band_numbers <= max(max_elements, max(block_numbers(chunk, dim) for chunk in band))
        for chunk in band:
            assert chunk.count == 1 or chunk.count * block_numbers(chunk, dim) <= max_elements
            for r, c in itertools.product(chunk.rows, chunk.cols):  # every block of a chunk has its shape
                assert (bounds[r + 1] - bounds[r], bounds[c + 1] - bounds[c]) == (chunk.height, chunk.width)
            shapes.add((chunk.height, chunk.width))
        order.extend((r, c) for r in rows for chunk in band for c in chunk.cols)
    assert order == [(r, c) for r in range(factor) for c in range(factor)]
    assert len(shapes) <= 4


@pytest.mark.parametrize("n,dim,factor,max_elements,rows,cols", [
    (37, 3, 7, 100, range(2, 5), range(3, 7)), (37, 3, 7, 10 ** 6, range(6, 7), range(0, 7)),
    (100, 16, 17, 5000, range(0, 17), range(15, 17)), (64, 2, 64, 300, range(10, 20), range(60, 64)),
])
def test_a_tiles_plan_covers_its_blocks_once_row_block_major(n, dim, factor, max_elements, rows, cols):
    """A job's tile is planned by the same function, restricted to its rectangle of blocks."""
    bounds = block_bounds(n, factor)
    order = []
    for band in plan_bands(n, dim, factor, max_elements, rows, cols):
        assert all(chunk.rows == band[0].rows for chunk in band)
        for chunk in band:
            assert chunk.count == 1 or chunk.count * block_numbers(chunk, dim) <= max_elements
            for r, c in itertools.product(chunk.rows, chunk.cols):
                assert (bounds[r + 1] - bounds[r], bounds[c + 1] - bounds[c]) == (chunk.height, chunk.width)
        order.extend((r, c) for r in band[0].rows for chunk in band for c in chunk.cols)
    assert order == [(r, c) for r in rows for c in cols]


def test_stacked_pairs_are_the_seed_matrix_blocks():
    vectors = torch.randn(11, 2, dtype=torch.float64)
    chunk = Chunk(range(0, 2), range(1, 3), 3, 3, 3)  # blocks (0..1) x (1..2) of factor 3
    stack = pair_blocks(vectors, chunk)  # (2, 2, 3, 3, 4)
    matrix = torch.cat((vectors[:, None].expand(11, 11, 2), vectors[None, :].expand(11, 11, 2)), dim=-1)
    for i, r in enumerate(chunk.rows):
        for j, c in enumerate(chunk.cols):
            assert torch.equal(stack[i, j], matrix[3 * r:3 * r + 3, 3 * c:3 * c + 3])


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_a_blocks_loss_depends_on_its_own_block_only(objective):
    """The engine's argument: the gradient of sum_j L_j with respect to stack[i] is dL_i/dstack[i]
    because no L_j (j != i) depends on stack[i]. Checked entry by entry with autograd."""
    torch.manual_seed(3)
    stack = (torch.randn(4, 2, 3, 4, dtype=torch.float64) * torch.tensor([1e-3, 1.0, 30.0, 1e3])[:, None, None, None]
             ).requires_grad_(True)
    losses = OBJECTIVES[objective].losses(stack, 2.5)  # (4,)
    assert losses.shape == (4,)
    for i in range(4):
        (grad,) = torch.autograd.grad(losses[i], stack, retain_graph=True)
        others = torch.cat([grad[:i], grad[i + 1:]])
        assert bool((others == 0).all())
        alone = OBJECTIVES[objective].losses(stack[i:i + 1].detach(), 2.5)
        # Stricter than the policy: the same block's reduction, alone or in a stack.
        assert_matches(alone[0], losses[i].detach(), torch.float64, rtol=1e-15, what=f"block {i} alone")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("objective", OBJECTIVES)
def test_stacked_blocks_are_bitwise_one_block_at_a_time(one_thread, objective, dtype):
    torch.manual_seed(5)
    vectors = torch.randn(100, 16, dtype=DTYPES[dtype])
    factor = 17  # base 5, last block 20 rows: all four shapes
    stacked = list(iter_blocks(vectors, factor, OBJECTIVES[objective], 2.5))
    alone = list(iter_blocks(vectors, factor, OBJECTIVES[objective], 2.5, max_elements=1))
    for a, b in zip(stacked, alone, strict=True):
        assert torch.equal(a.loss, b.loss) and torch.equal(a.gradient, b.gradient)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("objective,same_loss", [("sum", True), ("mean", False), ("sum_of_squares", True)])
def test_stacked_blocks_are_bitwise_the_seed_loops(one_thread, objective, same_loss, dtype):
    """Where the objective is written the same way as the literal loops, the numbers are the
    same bits. (mean's loss is summed over a strided view by the loops, so it differs in
    order; l2_norm and logsumexp are computed scaled and shifted: see test_engine.)"""
    torch.manual_seed(6)
    vectors = torch.randn(64, 8, dtype=DTYPES[dtype])
    factor = default_factor(64)  # 11: base 5, last 14
    blocks = list(iter_blocks(vectors, factor, OBJECTIVES[objective], 2.5))
    for block, (loss, grad) in zip(blocks, reference_blocks(vectors, factor, objective, 2.5), strict=True):
        assert torch.equal(block.gradient, grad)
        assert torch.equal(block.loss, loss) or not same_loss


def make_request(vectors, **kwargs):
    fields = dict(factor=7, objective="l2_norm", offset=5.0, outputs=("blocks", "accumulated"), dtype="float64")
    fields.update(kwargs)
    return GradientRequest(vectors=np.asarray(vectors, dtype=np.float64), **fields)


@pytest.mark.parametrize("chunk_elements", [1, 200, 4 * 1024 * 1024])
def test_recomputed_blocks_stream_in_order_and_match_the_kept_ones(chunk_elements):
    req = make_request(np.random.default_rng(4).standard_normal((37, 3)))
    vectors = load_vectors(req, torch.device("cpu"))
    kept = pass_one(req, torch.device("cpu"), vectors, Deadline(60), 10 ** 9, chunk_elements)
    recomputed = pass_one(req, torch.device("cpu"), vectors, Deadline(60), 0, chunk_elements)
    assert kept.kept is not None and recomputed.kept is None
    pairs = list(zip(kept.blocks(), recomputed.blocks(), strict=True))
    assert [(a.r, a.c) for a, _ in pairs] == [(r, c) for r in range(7) for c in range(7)]
    for a, b in pairs:
        assert (a.r, a.c, a.row_span, a.col_span) == (b.r, b.c, b.row_span, b.col_span)
        assert torch.equal(a.loss, b.loss) and torch.equal(a.gradient, b.gradient)
        assert torch.equal(kept.losses[a.r, a.c], a.loss)
    assert torch.equal(kept.accumulated, recomputed.accumulated)


def test_the_deadline_is_checked_between_chunks_of_pass_one():
    checks = []

    class Counting(Deadline):
        def check(self):
            checks.append(1)

    req = make_request(np.ones((37, 3)), outputs=("accumulated",))
    vectors = load_vectors(req, torch.device("cpu"))
    pass_one(req, torch.device("cpu"), vectors, Counting(60), 0, chunk_elements=1)
    assert len(checks) == len(list(plan_bands(37, 3, 7, 1))) == 49  # one block a chunk: a check a block


class ModelLike:
    """An objective as a model-backed one would be: a scorer per pair, summed per block,
    with `bytes_per_pair` of activations."""
    name, description, bytes_per_pair = "model_like", "sum of a per-pair score", 3 * 8 * 16

    def losses(self, blocks, offset):
        k, h, w, pair = blocks.shape
        scores = torch.tanh(blocks.reshape(k * h * w, pair)).sum(dim=1)  # (k*h*w,)
        return scores.reshape(k, h * w).sum(dim=1)  # (k,)


def test_chunks_shrink_for_an_objective_with_activation_memory():
    dim, element = 8, 8  # float64 pairs: 128 bytes; activations 384 bytes: a quarter of the pairs
    assert elements_per_chunk(4096, OBJECTIVES["sum"], dim, element) == 4096
    assert elements_per_chunk(4096, ModelLike(), dim, element) == 1024
    assert elements_per_chunk(1, ModelLike(), dim, element) == 1  # never below one number: a block still fits
    vectors = torch.randn(37, dim, dtype=torch.float64)
    blocks = list(iter_blocks(vectors, 7, ModelLike(), 0.0, elements_per_chunk(2000, ModelLike(), dim, element)))
    for block in blocks:  # against the same score written per block
        rows, cols = vectors[block.row_span[0]:block.row_span[1]], vectors[block.col_span[0]:block.col_span[1]]
        leaf = torch.cat((rows[:, None].expand(-1, len(cols), -1), cols[None].expand(len(rows), -1, -1)),
                         dim=-1).requires_grad_(True)
        loss = torch.tanh(leaf).sum()
        loss.backward()
        assert_matches(block.loss, loss, "float64", scale=torch.tanh(leaf).abs().sum().item())  # terms of either sign
        assert_matches(block.gradient, leaf.grad, "float64")


@pytest.mark.parametrize("chunk_elements", [1, 200, 4 * 1024 * 1024])
def test_the_first_non_finite_block_is_named_whatever_the_chunks(chunk_elements):
    from app.core.errors import BlockgradError
    vectors = np.zeros((37, 3))
    vectors[22, 1] = 1e20  # squares overflow float32; row 22 is in block row 4 (base 5), so (0, 4) comes first
    req = make_request(vectors, objective="sum_of_squares", dtype="float32")
    with pytest.raises(BlockgradError) as refused:
        pass_one(req, torch.device("cpu"), load_vectors(req, torch.device("cpu")), Deadline(60), 0, chunk_elements)
    assert refused.value.code == "non_finite_result"
    assert refused.value.details == {"block": {"row": 0, "col": 4}}
