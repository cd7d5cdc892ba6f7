"""Unit tests of app/core that kill mutants the rest of the fast suite let live (`make mutants`,
docs/testing.md). Expected values are literals worked out by hand from the docs' rules, or
tools/reference.py's; the cost model (its measured constants in app/core/admission.py) only where a
prediction is the input."""

import numpy as np
import pytest
import torch

from app.core.admission import AnswerCost, admit, advice, check_activations, check_block_and_answer, over_the_deadline
from app.core.errors import BlockgradError
from app.core.request import GradientRequest, Sizes
from app.core.slots import Deadline
from app.core.engine import DEFAULT_CHUNK_ELEMENTS, plan_bands
from app.core.run import pass_one
from tools.reference import reference_accumulated, reference_blocks

from .numeric import assert_matches
from app.core.settings import Settings


def refusal(call, *args) -> BlockgradError:
    with pytest.raises(BlockgradError) as info:
        call(*args)
    assert info.value.code == "limit_exceeded"
    return info.value


# Activations: the largest block's pairs x bytes_per_pair against BLOCKGRAD_MAX_ACTIVATION_BYTES.
# N = 10: factor 2 -> blocks of 5 (25 pairs), 3 -> 3, 3, 4 (16), 4 -> 2, 2, 2, 4 (16),
# 5 -> 2 each (4), 10 -> 1 pair.
@pytest.mark.parametrize("limit", [2500, 10 ** 9])
def test_activations_at_or_under_the_limit_are_admitted(limit):
    sizes = Sizes(10, 2, 2, ("blocks",), bytes_per_pair=100)
    assert check_activations(sizes, Settings(max_activation_bytes=limit)) is None


@pytest.mark.parametrize("limit,fitting", [(2499, 3), (1600, 3), (1599, 5), (400, 5), (399, 10), (100, 10)])
def test_activations_over_the_limit_name_the_smallest_larger_factor_that_fits(limit, fitting):
    sizes = Sizes(10, 2, 2, ("blocks",), bytes_per_pair=100)
    error = refusal(check_activations, sizes, Settings(max_activation_bytes=limit))
    assert error.details == {"limit": "BLOCKGRAD_MAX_ACTIVATION_BYTES", "value": 2500, "allowed": limit}
    assert f"factor {fitting} fits" in error.message and "about 2500 bytes (100 bytes per pair)" in error.message


def test_activations_with_a_remainder_block_count_the_larger_last_block():
    # N = 7, factor 3: blocks of 2, 2 and 3 rows -> the largest holds 9 pairs.
    error = refusal(check_activations, Sizes(7, 1, 3, ("blocks",), bytes_per_pair=10), Settings(max_activation_bytes=89))
    assert (error.details["value"], error.details["allowed"]) == (90, 89)
    # factor 4: 1, 1, 1, 4 rows (16 pairs); 5: 1, 1, 1, 1, 3 (9); 6: last block 2 rows (4 pairs).
    assert "factor 6 fits" in error.message


def test_activations_too_large_for_one_pair():
    error = refusal(check_activations, Sizes(10, 2, 2, ("blocks",), bytes_per_pair=100),
                    Settings(max_activation_bytes=99))
    assert error.details["value"] == 2500 and error.message == (
        "With factor 2 the model's activations for the largest block take about 2500 bytes (100 bytes per "
        "pair), over BLOCKGRAD_MAX_ACTIVATION_BYTES = 99; this model's activations for even one pair are too large.")
    assert "suggested_factor" not in error.details


def test_built_in_objectives_have_no_activation_limit():
    assert check_activations(Sizes(10, 2, 2, ("blocks",)), Settings(max_activation_bytes=0)) is None


# The deadline: admission refuses what the cost model predicts over BLOCKGRAD_REQUEST_TIMEOUT_S.
# With BLOCKGRAD_MAX_BLOCK_ELEMENTS = 2 and D = 1 only 1 x 1 blocks fit (2 numbers each), so the
# only factor that fits N = 4 is 4, whatever the cost model says.
ONLY_FACTOR_4 = dict(max_block_elements=2)


def test_over_the_deadline_suggests_the_factor_that_fits_when_it_meets_the_deadline():
    settings = Settings(request_timeout_s=10.0, **ONLY_FACTOR_4)
    error = over_the_deadline(Sizes(4, 1, 2, ("blocks",)), 12.34567, settings)
    assert error.code == "limit_exceeded"
    assert error.details == {"limit": "BLOCKGRAD_REQUEST_TIMEOUT_S", "value": 12.346, "allowed": 10.0,
                             "predicted_s": 12.346, "deadline_s": 10.0, "suggested_factor": 4}
    assert "about 12.3 s" in error.message and "factor 4 is predicted" in error.message


def test_over_the_deadline_without_a_better_factor_suggests_none():
    settings = Settings(request_timeout_s=10.0, **ONLY_FACTOR_4)
    error = over_the_deadline(Sizes(4, 1, 4, ("blocks",)), 12.0, settings)
    assert error.details == {"limit": "BLOCKGRAD_REQUEST_TIMEOUT_S", "value": 12.0, "allowed": 10.0,
                             "predicted_s": 12.0, "deadline_s": 10.0}
    assert error.message == ("This request is predicted to take about 12 s, over the deadline "
                             "BLOCKGRAD_REQUEST_TIMEOUT_S = 10 s; send fewer vectors or ask for fewer outputs.")


# Every cost constant pinned (BLOCKGRAD_COST_PER_BLOCK_S / _PER_NUMBER_S replace compute and
# output costs alike) to powers of two, so the predictions below are exact. The cost model
# (app/core/admission.py; docs/performance.md, "Choosing a factor"):
#   seconds = stages x (blocks x b + numbers x u) + [blocks asked] (blocks x b + N x N x 2D x u)
#   blocks = F x F, numbers = N x N x 2D + F x N x 2D (no block over a 1M-number chunk here);
#   stages = 1: `sum`, the default objective, keeps its gradients from pass one.
PINNED_COSTS = dict(cost_per_block_s=1 / 8, cost_per_number_s=1 / 64)


def test_over_the_deadline_suggests_a_factor_predicted_to_meet_it_exactly():
    """The suggestion's own prediction (factor 4's, not the request's factor 2's) against the deadline."""
    sizes = Sizes(4, 1, 2, ("blocks",))
    # N = 4, D = 1 (2D = 2), blocks asked. Factor 4: blocks 16, numbers 32 + 4 x 4 x 2 = 64:
    #   (16/8 + 64/64) + (16/8 + 32/64) = 3 + 2.5 = 5.5 s.
    # Factor 2 (the request's): blocks 4, numbers 32 + 2 x 4 x 2 = 48:
    #   (4/8 + 48/64) + (4/8 + 32/64) = 1.25 + 1 = 2.25 s, "2.2" against factor 4's "5.5".
    better_s = 5.5
    error = over_the_deadline(sizes, 99.0, Settings(request_timeout_s=better_s, **ONLY_FACTOR_4, **PINNED_COSTS))
    assert error.details["suggested_factor"] == 4
    assert "factor 4 is predicted to take about 5.5 s" in error.message
    slower = over_the_deadline(sizes, 99.0, Settings(request_timeout_s=better_s - 1e-9, **ONLY_FACTOR_4,
                                                     **PINNED_COSTS))
    assert "suggested_factor" not in slower.details  # 5.5 s exactly: a hair under it is too slow


def test_over_the_deadline_does_not_suggest_a_factor_that_is_also_too_slow():
    settings = Settings(request_timeout_s=1e-12, **ONLY_FACTOR_4)
    error = over_the_deadline(Sizes(4, 1, 2, ("blocks",)), 1.0, settings)
    assert "suggested_factor" not in error.details and error.details["deadline_s"] == 1e-12


# N = 64, D = 8 (2D = 16), F = 4: blocks 16, numbers 64 x 64 x 16 + 4 x 64 x 16 = 65,536 + 4,096 = 69,632;
# compute 16/8 + 69,632/64 = 2 + 1,088 = 1,090 s; writing the blocks 16/8 + 65,536/64 = 2 + 1,024 = 1,026 s.
@pytest.mark.parametrize("outputs,predicted", [(("blocks",), 2116.0), (("accumulated", "losses"), 1090.0)])
def test_admit_refuses_past_the_deadline_and_admits_at_it(outputs, predicted):
    sizes = Sizes(64, 8, 4, outputs)
    error = refusal(admit, sizes, AnswerCost(), Settings(request_timeout_s=predicted / 2, **PINNED_COSTS))
    assert error.details["limit"] == "BLOCKGRAD_REQUEST_TIMEOUT_S" and error.details["value"] == predicted
    assert admit(sizes, AnswerCost(), Settings(request_timeout_s=predicted, **PINNED_COSTS)).seconds == predicted


def test_admit_predicts_no_time_for_no_outputs():
    """/v2 asking only for bounds computes nothing: no time, no refusal even at a zero deadline."""
    assert admit(Sizes(64, 8, 4, ()), AnswerCost(), Settings(request_timeout_s=0.0)).seconds == 0.0


# The answer's size: N = 4, D = 3, factor 2 -> blocks 4 * 4 * 6 = 96, accumulated 12, losses 4.
@pytest.mark.parametrize("outputs,total", [(("blocks", "accumulated", "losses"), 112), (("accumulated",), 12)])
def test_an_answer_at_the_output_limit_is_admitted_and_one_over_refused(outputs, total):
    sizes = Sizes(4, 3, 2, outputs)
    assert check_block_and_answer(sizes, Settings(max_output_elements=total)) is None
    error = refusal(check_block_and_answer, sizes, Settings(max_output_elements=total - 1))
    assert (error.details["limit"], error.details["value"], error.details["allowed"]) == (
        "BLOCKGRAD_MAX_OUTPUT_ELEMENTS", total, total - 1)


def test_a_block_at_the_block_limit_is_admitted_and_one_over_refused():
    sizes = Sizes(4, 3, 1, ("accumulated",))  # one block of 4 x 4 x 6 = 96 numbers
    assert check_block_and_answer(sizes, Settings(max_block_elements=96)) is None
    error = refusal(check_block_and_answer, sizes, Settings(max_block_elements=95))
    assert (error.details["limit"], error.details["value"], error.details["allowed"]) == (
        "BLOCKGRAD_MAX_BLOCK_ELEMENTS", 96, 95)


def test_an_answer_over_the_limit_gets_a_factor_only_when_the_losses_are_what_is_over():
    """N = 4, D = 3: accumulated is 12 numbers, losses F x F. With 20 allowed, factor 4 (28) is
    over because of its losses and factors 1 and 2 fit; with 12 allowed no factor can."""
    losses_over = refusal(check_block_and_answer, Sizes(4, 3, 4, ("accumulated", "losses")),
                          Settings(max_output_elements=20))
    assert losses_over.details["value"] == 28 and losses_over.details["suggested_factor"] in {1, 2}
    fixed_over = refusal(check_block_and_answer, Sizes(4, 3, 2, ("accumulated", "losses")),
                         Settings(max_output_elements=12))
    assert fixed_over.details == {"limit": "BLOCKGRAD_MAX_OUTPUT_ELEMENTS", "value": 16, "allowed": 12}
    assert fixed_over.message == (
        "The answer would hold 16 numbers, over BLOCKGRAD_MAX_OUTPUT_ELEMENTS = 12; ask for fewer outputs "
        "(for example only accumulated and losses) or send fewer vectors.")


# Advice when no factor fits: one pair of D = 3 is 6 numbers; N = 4 x D = 3 of accumulated is 12.
def test_advice_when_even_one_pair_is_over_the_block_limit():
    sizes = Sizes(4, 3, 1, ("accumulated",))
    assert advice(sizes, Settings(max_block_elements=5)) == ("send shorter vectors: even one pair is too large", {})


def test_advice_when_one_pair_fits_exactly_but_the_answer_never_does():
    sizes = Sizes(4, 3, 1, ("accumulated",))
    assert advice(sizes, Settings(max_block_elements=6, max_output_elements=11)) == (
        "no factor fits every limit with outputs accumulated: ask for fewer outputs (for example only "
        "accumulated and losses) or send fewer vectors", {})


# first_non_finite_block: which block a non_finite_result names. In float32, sum_of_squares
# overflows on any block holding a row of 3e38 (its loss and its gradient 2 * 3e38).
def overflowing(n: int, factor: int, row: int) -> tuple[GradientRequest, torch.Tensor]:
    vectors = np.ones((n, 1), dtype=np.float32)
    vectors[row] = 3e38
    req = GradientRequest(vectors, factor, "sum_of_squares", 0.0, ("blocks",), "float32")
    return req, torch.as_tensor(vectors)


def named_block(req: GradientRequest, vectors: torch.Tensor, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> dict:
    with pytest.raises(BlockgradError) as info:
        pass_one(req, torch.device("cpu"), vectors, Deadline(60.0), 0, chunk_elements)
    assert info.value.code == "non_finite_result"
    return info.value.details["block"]


def test_the_first_non_finite_block_may_be_in_a_bands_second_chunk():
    """N = 5, factor 4: blocks of 1, 1, 1 and 2 rows; a band's first chunk holds columns 0-2,
    its second the wider column 3. Row 4 (in block 3) overflows: the first such block,
    row-block-major, is (0, 3), in the first band's second chunk."""
    assert named_block(*overflowing(5, 4, row=4)) == {"row": 0, "col": 3}


def test_a_finite_block_in_a_suspect_chunk_is_not_named():
    """Row 2 overflows (block 2 of 4): in the chunk of the first block row, (0, 0) and (0, 1)
    are finite and (0, 2) is not; one block per chunk or the whole row in one, the same block."""
    req, vectors = overflowing(4, 4, row=2)
    assert named_block(req, vectors) == {"row": 0, "col": 2}
    assert named_block(req, vectors, chunk_elements=1) == {"row": 0, "col": 2}


# pass one keeps blocks while their gradients fit keep_bytes, else lets them go and recomputes
# them from the vectors when written. N = 6, factor 2, D = 2, sum_of_squares in
# float64: one chunk of 2 x 2 blocks of 3 x 3 x 4 gradients, 144 numbers, 1152 bytes.
GRADIENT_BYTES = 144 * 8


@pytest.mark.parametrize("keep_bytes,kept", [(GRADIENT_BYTES, True), (GRADIENT_BYTES - 1, False)])
def test_pass_one_keeps_blocks_within_the_budget_and_recomputes_them_past_it(keep_bytes, kept):
    vectors = np.random.default_rng(27).standard_normal((6, 2))
    req = GradientRequest(vectors, 2, "sum_of_squares", 0.0, ("blocks", "accumulated"), "float64")
    tensor = torch.as_tensor(vectors)
    assert len([chunk for band in plan_bands(6, 2, 2, DEFAULT_CHUNK_ELEMENTS) for chunk in band]) == 1
    result = pass_one(req, torch.device("cpu"), tensor, Deadline(60.0), keep_bytes, DEFAULT_CHUNK_ELEMENTS)
    assert (result.kept is not None) == kept
    blocks = list(result.blocks())
    expected = reference_blocks(tensor, 2, "sum_of_squares", offset=0.0)
    assert [(b.r, b.c, b.row_span, b.col_span) for b in blocks] == [
        (0, 0, (0, 3), (0, 3)), (0, 1, (0, 3), (3, 6)), (1, 0, (3, 6), (0, 3)), (1, 1, (3, 6), (3, 6))]
    for block, (loss, gradient) in zip(blocks, expected, strict=True):
        assert_matches(block.loss, loss, "float64")
        assert_matches(block.gradient, gradient, "float64")
    assert_matches(result.accumulated, reference_accumulated(tensor, 2, "sum_of_squares", offset=0.0), "float64")
