"""The numeric core against the literal seed loops, and against finite differences."""
import math

import numpy as np
import pytest
import torch

from app.core.engine import add_to_vectors, band_blocks, block_bounds, chain_rule_sums, chunk_gradients, plan_bands
from app.core.request import GradientRequest, default_factor
from app.core.run import Deadline, run
from app.core.settings import Settings
from app.http.errors import error_headers, status_of
from app.core.errors import BlockgradError
from app.core.objectives import OBJECTIVES

from tools.reference import batch_matrix, concat_matrix, reference_accumulated, reference_blocks

from .numeric import assert_matches, loss_terms

DTYPES = {"float32": torch.float32, "float64": torch.float64}
SHAPES = [  # (N, D, F): default split, N not divisible by F, F = 1, F = N, N = 1
    (10, 5, 2), (11, 3, 3), (13, 4, 4), (7, 2, 1), (6, 3, 6), (1, 4, 1), (9, 1, 2),
]


def engine_run(vectors, factor, objective, offset=5.0, max_elements=4 * 1024 * 1024):
    blocks, accumulated = [], torch.zeros_like(vectors)
    for band in plan_bands(*vectors.shape, factor, max_elements):
        results = [chunk_gradients(vectors, chunk, OBJECTIVES[objective], offset) for chunk in band]
        for result in results:
            add_to_vectors(accumulated, accumulated, result.chunk, chain_rule_sums(result))
        blocks.extend(band_blocks(results))
    return blocks, accumulated


def assert_matches_seed_loops(vectors, factor, objective, chunk_sizes=(4 * 1024 * 1024,)):
    inputs = batch_matrix(concat_matrix(vectors), factor=factor)
    expected_blocks = reference_blocks(vectors, factor, objective, offset=2.5)
    expected_accumulated = reference_accumulated(vectors, factor, objective, offset=2.5)
    bounds = block_bounds(vectors.shape[0], factor)
    for max_elements in chunk_sizes:
        blocks, accumulated = engine_run(vectors, factor, objective, offset=2.5, max_elements=max_elements)
        assert len(blocks) == len(expected_blocks) == factor * factor
        for k, (block, (loss, grad)) in enumerate(zip(blocks, expected_blocks, strict=True)):
            r, c = divmod(k, factor)  # row-block-major, as the seed's loops
            assert (block.r, block.c) == (r, c)
            assert (block.row_span, block.col_span) == ((bounds[r], bounds[r + 1]), (bounds[c], bounds[c + 1]))
            assert block.gradient.dtype == vectors.dtype
            assert block.gradient.shape == grad.shape
            assert_matches(block.loss, loss, vectors.dtype, scale=loss_terms(inputs[k], objective, 2.5),
                           what=f"block {k} loss")
            assert_matches(block.gradient, grad, vectors.dtype, what=f"block {k} gradient")
        assert_matches(accumulated, expected_accumulated, vectors.dtype, what="accumulated")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("n,d,factor", SHAPES)
def test_engine_matches_seed_loops(n, d, factor, objective, dtype):
    torch.manual_seed(n * 100 + d * 10 + factor)
    vectors = torch.randn(n, d, dtype=DTYPES[dtype])
    # The default chunk (every block of a shape together), one block per chunk, and a few.
    assert_matches_seed_loops(vectors, factor, objective, chunk_sizes=(4 * 1024 * 1024, 1, 40))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("factor", [1, 2, default_factor(37), 30, 37])  # small, default (7), large, N
def test_engine_matches_seed_loops_at_small_default_and_large_factors(factor, objective, dtype):
    # N = 37 is prime: N % F != 0 for every F but 1 and N; 30 leaves a last block of 8 rows.
    torch.manual_seed(factor)
    vectors = torch.randn(37, 3, dtype=DTYPES[dtype])
    assert_matches_seed_loops(vectors, factor, objective, chunk_sizes=(4 * 1024 * 1024, 1, 100))


def test_seed_example_values():
    vectors = torch.randn(10, 5)
    blocks, accumulated = engine_run(vectors, default_factor(10), "sum")
    assert default_factor(10) == 2
    assert [b.gradient.shape for b in blocks] == [torch.Size([5, 5, 10])] * 4
    assert all(bool((b.gradient == 1).all()) for b in blocks)
    assert bool((accumulated == 20).all())


@pytest.mark.parametrize("n,factor,expected", [
    (10, 2, [0, 5, 10]), (11, 3, [0, 3, 6, 11]), (7, 1, [0, 7]), (6, 6, [0, 1, 2, 3, 4, 5, 6]), (1, 1, [0, 1]),
])
def test_block_bounds(n, factor, expected):
    assert block_bounds(n, factor) == expected


@pytest.mark.parametrize("n,expected", [(1, 1), (6, 1), (7, 2), (10, 2), (12, 2), (13, 3), (4096, 683)])
def test_default_factor_is_ceil_n_over_6(n, expected):
    assert default_factor(n) == expected == math.ceil(n / 6)


def test_l2_norm_gradient_is_zero_not_nan_at_zero():
    blocks, accumulated = engine_run(torch.zeros(4, 3, dtype=torch.float64), 2, "l2_norm")
    for block in blocks:
        assert float(block.loss) == 0.0
        assert bool((block.gradient == 0).all())
    assert bool((accumulated == 0).all())


class EngineTotalLoss(torch.autograd.Function):
    """S(V) = sum of block losses, with the engine's accumulated gradient as backward."""

    @staticmethod
    def forward(ctx, vectors, factor, objective):
        blocks, accumulated = engine_run(vectors.detach(), factor, objective)
        ctx.save_for_backward(accumulated)
        return torch.stack([b.loss for b in blocks]).sum()

    @staticmethod
    def backward(ctx, grad_out):
        (accumulated,) = ctx.saved_tensors
        return grad_out * accumulated, None, None


class EngineBlockLoss(torch.autograd.Function):
    """L(B) for one block, with the engine's block gradient as backward."""

    @staticmethod
    def forward(ctx, vectors, factor, objective, index):
        block = engine_run(vectors.detach(), factor, objective)[0][index]
        ctx.save_for_backward(block.gradient)
        ctx.rows, ctx.cols, ctx.n = block.row_span, block.col_span, vectors.shape[0]
        return block.loss

    @staticmethod
    def backward(ctx, grad_out):
        # Map dL/dB onto V for this one block, the same chain rule written out.
        (grad,) = ctx.saved_tensors
        d = grad.shape[2] // 2
        out = torch.zeros(ctx.n, d, dtype=grad.dtype)
        out[ctx.rows[0]:ctx.rows[1]] += grad[:, :, :d].sum(1)
        out[ctx.cols[0]:ctx.cols[1]] += grad[:, :, d:].sum(0)
        return grad_out * out, None, None, None


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_gradcheck_accumulated_and_blocks(objective):
    torch.manual_seed(7)
    vectors = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v: EngineTotalLoss.apply(v, 2, objective), (vectors,))
    for index in (0, 3):  # a square block and the ragged last one
        assert torch.autograd.gradcheck(lambda v: EngineBlockLoss.apply(v, 2, objective, index), (vectors,))


CPU = Settings(device="cpu")


def make_request(vectors, **kwargs):
    fields = dict(factor=2, objective="sum", offset=5.0, outputs=("blocks", "accumulated"), dtype="float32")
    fields.update(kwargs)
    return GradientRequest(vectors=np.asarray(vectors, dtype=np.float64), **fields)


def test_summarize_names_the_non_finite_block():
    vectors = np.zeros((4, 2))
    vectors[3, 0] = 1e20  # (1e20)^2 overflows float32; V[3] is a column of block (0, 1) first
    req = make_request(vectors, objective="sum_of_squares")
    with pytest.raises(BlockgradError) as info:
        run(req, CPU, Deadline(60))
    assert info.value.code == "non_finite_result"
    assert info.value.details == {"block": {"row": 0, "col": 1}}


def test_summarize_float64_keeps_what_float32_cannot():
    vectors = np.zeros((4, 2))
    vectors[3, 0] = 1e20
    req = make_request(vectors, objective="sum_of_squares", dtype="float64")
    summary = run(req, CPU, Deadline(60))
    assert summary.losses.dtype == torch.float64
    # block (1, 1) pairs V[2:4] with V[2:4]: V[3, 0] = 1e20 is in four of its entries, the rest 0
    assert_matches(summary.losses[1, 1], 4 * 1e40, torch.float64, what="loss of block (1, 1)")


def test_deadline_stops_between_blocks():
    req = make_request(np.ones((6, 2)), factor=3)
    deadline = Deadline(60)
    deadline.expires = 0  # already past
    with pytest.raises(BlockgradError) as info:
        run(req, CPU, deadline)
    assert status_of(info.value) == 503 and info.value.code == "deadline_exceeded"
    assert int(error_headers(info.value)["Retry-After"]) >= 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("objective", OBJECTIVES)
def test_cuda_matches_cpu_and_the_seed_loops(objective):
    """CUDA against the literal loops on the CPU (the oracle) and against the CPU engine, under numeric.py."""
    vectors = torch.randn(37, 8, dtype=torch.float64)
    cpu_blocks, cpu_acc = engine_run(vectors, 5, objective)
    gpu_blocks, gpu_acc = engine_run(vectors.cuda(), 5, objective)
    expected = reference_blocks(vectors, 5, objective)
    inputs = batch_matrix(concat_matrix(vectors), factor=5)
    assert len(gpu_blocks) == len(cpu_blocks) == len(expected) == 25
    assert_matches(gpu_acc, reference_accumulated(vectors, 5, objective), torch.float64, what="cuda accumulated")
    assert_matches(gpu_acc, cpu_acc, torch.float64, what="cuda accumulated against the cpu's")
    for k, (gpu, cpu, (loss, grad)) in enumerate(zip(gpu_blocks, cpu_blocks, expected, strict=True)):
        assert (gpu.r, gpu.c) == (cpu.r, cpu.c) == divmod(k, 5)
        assert gpu.gradient.device.type == "cuda"
        assert_matches(gpu.gradient, grad, torch.float64, what=f"cuda block {k} gradient")
        assert_matches(gpu.gradient, cpu.gradient, torch.float64, what=f"cuda block {k} gradient against the cpu's")
        assert_matches(gpu.loss, loss, torch.float64, scale=loss_terms(inputs[k], objective), what=f"cuda block {k} loss")


@pytest.mark.parametrize("dtype", DTYPES)
def test_logsumexp_gradient_stays_exact_for_large_values(dtype):
    # One vector (a, b), one 1 x 1 block [a, b, a, b] with b - a = ln 3: softmax 1/8, 3/8, 1/8, 3/8.
    a = 1e4 if dtype == "float64" else 1e8
    vectors = torch.tensor([[a, a + math.log(3)]], dtype=DTYPES[dtype])
    if dtype == "float32":  # ln 3 is lost next to 1e8 in float32: equal entries, softmax 1/4 each
        expected_grad, expected_acc = [0.25] * 4, [0.5, 0.5]
    else:
        expected_grad, expected_acc = [0.125, 0.375, 0.125, 0.375], [0.25, 0.75]
    blocks, accumulated = engine_run(vectors, 1, "logsumexp")
    assert_matches(blocks[0].gradient.flatten(), expected_grad, dtype)
    assert_matches(accumulated.flatten(), expected_acc, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_l2_norm_of_tiny_values_does_not_underflow(dtype):
    vectors = torch.tensor([[1e-23, 1e-23]], dtype=DTYPES[dtype])  # squares (1e-46) underflow float32
    blocks, accumulated = engine_run(vectors, 1, "l2_norm")
    assert_matches(blocks[0].loss, torch.tensor(1e-23, dtype=DTYPES[dtype]) * 2, dtype)  # 2e-23 rounded as the service's
    assert_matches(blocks[0].gradient.flatten(), [0.5] * 4, dtype)
    assert_matches(accumulated.flatten(), [1.0, 1.0], dtype)

