"""The seed's 10 x 5 example through run: the seed loops' numbers, blocks kept or recomputed
alike, and what is not finite named."""
import numpy as np
import pytest
import torch

from app.core.errors import BlockgradError
from app.core.request import GradientRequest
from app.core.run import run
from app.core.settings import Settings

from tools.reference import batch_matrix, concat_matrix, reference_accumulated, reference_blocks

from .numeric import assert_matches, loss_terms

CPU = Settings(device="cpu")
SEED = np.arange(50, dtype=np.float64).reshape(10, 5) / 7 - 3  # 10 x 5, every entry distinct


def request(vectors, **fields) -> GradientRequest:
    fields = {"factor": 2, "objective": "sum", "offset": 5.0, "outputs": ("blocks", "accumulated"),
              "dtype": "float32", **fields}
    return GradientRequest(vectors=np.asarray(vectors, dtype=np.float64), **fields)


@pytest.mark.parametrize("objective", ["sum", "mean", "sum_of_squares", "l2_norm"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_seed_request_gives_the_seed_loops_numbers(one_thread, objective, dtype):
    result = run(request(SEED, objective=objective, dtype=dtype), CPU)
    # The literal loops in float64 on the values the service holds (rounded to dtype): the oracle.
    reference = torch.tensor(SEED, dtype=getattr(torch, dtype)).to(torch.float64)
    expected = reference_blocks(reference, 2, objective)
    inputs = batch_matrix(concat_matrix(reference), factor=2)
    assert result.kept is not None and len(result.kept) == len(expected) == 4
    for k, (block, (loss, gradient)) in enumerate(zip(result.kept, expected, strict=True)):
        assert_matches(block.gradient, gradient, dtype, what=f"block {k} gradient")
        assert_matches(block.loss, loss, dtype, scale=loss_terms(inputs[k], objective), what=f"block {k} loss")
    assert_matches(result.accumulated, reference_accumulated(reference, 2, objective), dtype, what="accumulated")


def test_blocks_too_large_to_keep_are_recomputed_as_streamed():
    req = request(SEED)
    result = run(req, Settings(device="cpu", max_block_elements=1))
    assert result.kept is None
    blocks = list(result.blocks())
    assert [(b.r, b.c) for b in blocks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    kept = run(req, CPU).kept
    assert all(torch.equal(a.gradient, b.gradient) for a, b in zip(blocks, kept, strict=True))


def test_what_is_not_finite_is_named():
    vectors = np.zeros((10, 5))
    vectors[7, 1] = 1e20  # squares overflow float32; row 7 is in block row 1: block (0, 1) comes first
    with pytest.raises(BlockgradError) as refused:
        run(request(vectors, objective="sum_of_squares"), CPU)
    assert refused.value.code == "non_finite_result"
    assert refused.value.details == {"block": {"row": 0, "col": 1}}
