"""The one comparison with the reference (tests/numeric.py) can fail where it should."""
from decimal import Decimal

import numpy as np
import pytest
import torch

from tools.reference import reference_accumulated, reference_blocks

from .numeric import assert_matches, assert_near_exact


def mean_answer(client, n=37):
    vectors = torch.randn(n, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(torch.float32)
    response = client.post("/v1/gradients", json={"vectors": vectors.tolist(), "factor": 1, "objective": "mean"})
    assert response.status_code == 200
    return vectors, response.get_json()


def test_mean_at_37_matches_and_a_1_percent_error_fails(client):
    vectors, body = mean_answer(client)
    expected = reference_blocks(vectors, 1, "mean")
    assert len(body["blocks"]) == len(expected) == 1
    for block, (_, grad) in zip(body["blocks"], expected, strict=True):
        assert grad.abs().max() < 2e-4  # entries of about 1.2e-4
        got = np.array(block["gradient"], dtype=np.float32)
        assert_matches(got, grad, "float32")
        for wrong in (got * np.float32(1.01), got * np.float32(0.99)):
            with pytest.raises(AssertionError, match="entries off the reference"):
                assert_matches(wrong, grad, "float32")
        # The tolerance this replaces let a 16% error through on these entries.
        torch.testing.assert_close(torch.from_numpy(got * np.float32(1.16)), grad, rtol=2e-5, atol=2e-5)
    accumulated = np.array(body["accumulated"], dtype=np.float32)
    assert_matches(accumulated, reference_accumulated(vectors, 1, "mean"), "float32")
    with pytest.raises(AssertionError):
        assert_matches(accumulated * np.float32(1.01), reference_accumulated(vectors, 1, "mean"), "float32")


def test_one_entry_wrong_fails_and_a_tiny_entry_is_held_relatively():
    expected = np.array([1.0, 9.6e-23, 0.5])
    assert_matches(expected * (1 + 1e-6), expected, "float32")
    for wrong in ([1.0, 0.0, 0.5], [1.0, 1.1e-22, 0.5], [1.0, 9.6e-23, 0.5001], [1.0, np.nan, 0.5], [1.0, np.inf, 0.5]):
        with pytest.raises(AssertionError):
            assert_matches(np.array(wrong), expected, "float32")


def test_float64_is_held_tighter_than_float32():
    expected = np.array([1.0, 2.0])
    assert_matches(expected * (1 + 1e-6), expected, "float32")
    with pytest.raises(AssertionError):
        assert_matches(expected * (1 + 1e-6), expected, "float64")


def test_shapes_must_agree_and_the_oracle_must_be_finite():
    with pytest.raises(AssertionError, match="shape"):
        assert_matches(np.zeros(3), np.zeros(4), "float32")
    with pytest.raises(AssertionError, match="oracle"):
        assert_matches(np.zeros(2), np.array([0.0, np.nan]), "float32")


def test_scale_is_a_floor_for_sums_that_cancel():
    expected = np.array([1e-3])  # a sum of terms of about 1
    assert_matches(expected + 1e-6, expected, "float32", scale=1.0)
    with pytest.raises(AssertionError):
        assert_matches(expected + 1e-6, expected, "float32")


def test_a_scale_near_the_largest_float64_does_not_pass_everything():
    """|expected| + scale past 1.8e308 must not make the tolerance infinite (then any answer passes)."""
    assert_matches([1.7e308], [1.7e308], "float64", scale=1.7e308)
    for wrong in (1.0e308, -1.7e308, 0.0):
        with pytest.raises(AssertionError):
            assert_matches([wrong], [1.7e308], "float64", scale=1.7e308)


def test_an_exact_reference_holds_subnormals_to_their_grid():
    tiny = float(np.finfo(np.float32).smallest_subnormal)  # 1.4e-45
    assert_near_exact(3 * tiny, Decimal(3 * tiny), "float32")
    assert_near_exact(4 * tiny, Decimal(3 * tiny), "float32")  # one unit of the grid
    with pytest.raises(AssertionError):
        assert_near_exact(5 * tiny, Decimal(3 * tiny), "float32")  # assert_matches' floor would pass it
    assert_matches([5 * tiny], [3 * tiny], "float32")
    with pytest.raises(AssertionError):
        assert_near_exact(1.0001, Decimal(1), "float32")
