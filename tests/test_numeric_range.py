"""Every objective at both ends of each dtype's range (issue 11: l2_norm with subnormal
inputs returned wrong gradients), against an exact reference: the seed's literal slicing,
then each loss and gradient written out in decimal arithmetic with 400 digits.

A 200 must carry the right numbers; the only allowed refusal is non_finite_result where
the exact answer itself overflows the dtype."""
import decimal
from decimal import Decimal

import numpy as np
import pytest
import torch

from app.core.errors import BlockgradError
from app.core.objectives import OBJECTIVES
from app.core.request import GradientRequest
from app.core.run import Deadline, run
from app.core.settings import Settings

from tools.reference import batch_matrix, concat_matrix

from .numeric import assert_matches, assert_near_exact

NUMPY = {"float32": np.float32, "float64": np.float64}
OFFSET = 2.5
# 400 digits: logsumexp subtracts its loss (up to 1.8e308) from each entry, which must stay exact to ~1.
CONTEXT = decimal.Context(prec=400, Emax=10 ** 6, Emin=-10 ** 6)
NEGLIGIBLE = Decimal(-10 ** 4)  # exp below this is under 1e-4000: 0 to 400 digits, and Decimal's exp stays finite


def exp(x: Decimal) -> Decimal:
    return CONTEXT.exp(x) if x > NEGLIGIBLE else Decimal(0)


def exact_block(entries: list[Decimal], objective: str) -> tuple[Decimal, list[Decimal]]:
    """Loss and gradient of one block, from the definitions."""
    c = CONTEXT
    count = Decimal(len(entries))
    if objective == "sum":
        return c.add(sum(entries, Decimal(0)), Decimal(OFFSET) * count), [Decimal(1)] * len(entries)
    if objective == "mean":
        return c.divide(sum(entries, Decimal(0)), count), [c.divide(1, count)] * len(entries)
    if objective == "sum_of_squares":
        return sum((c.multiply(b, b) for b in entries), Decimal(0)), [2 * b for b in entries]
    if objective == "l2_norm":
        norm = c.sqrt(sum((c.multiply(b, b) for b in entries), Decimal(0)))
        return norm, [c.divide(b, norm) if norm else Decimal(0) for b in entries]
    if objective == "logsumexp":
        top = max(entries)
        total = sum((exp(b - top) for b in entries), Decimal(0))
        loss = top + c.ln(total)
        return loss, [exp(c.subtract(b, loss)) for b in entries]
    raise AssertionError(objective)


def exact_answer(vectors: np.ndarray, factor: int, objective: str):
    """[(loss, gradient entries)] row-block-major, and the accumulated gradient, all Decimal."""
    with decimal.localcontext(CONTEXT):
        matrix = concat_matrix(torch.as_tensor(vectors, dtype=torch.float64))  # exact copies of V's values
        n, d = vectors.shape
        accumulated = [[Decimal(0)] * d for _ in range(n)]
        bounds = [k * (n // factor) for k in range(factor)] + [n]
        answer = []
        for k, block in enumerate(batch_matrix(matrix, factor)):
            r, c = divmod(k, factor)
            values = block.reshape(-1).tolist()
            loss, grad = exact_block([Decimal(v) for v in values], objective)
            answer.append((loss, grad))
            h, w = block.shape[:2]
            for i in range(h):
                for j in range(w):
                    entry = grad[(i * w + j) * 2 * d:(i * w + j + 1) * 2 * d]
                    for t in range(d):
                        accumulated[bounds[r] + i][t] += entry[t]
                        accumulated[bounds[c] + j][t] += entry[d + t]
        return answer, accumulated


def representable(value: Decimal, dtype: str) -> bool:
    return abs(value) <= Decimal(float(np.finfo(NUMPY[dtype]).max))


CASES = [  # (dtype, scale): the subnormal and near-maximum ends, and squares that underflow
    ("float32", 1e-45), ("float32", 1e-42), ("float32", 1e-40), ("float32", 1e-23), ("float32", 1e36),
    ("float32", 3e38), ("float64", 1e-320), ("float64", 1e-310), ("float64", 1e-160), ("float64", 1e306),
    ("float64", 1.7e308),
]


def scaled_vectors(dtype: str, scale: float, seed: int) -> np.ndarray:
    """(5, 2) values in [scale / 2, scale], some zeros, rounded to `dtype` (the numbers the engine gets)."""
    values = np.random.default_rng(seed).uniform(0.5, 1.0, (5, 2)) * scale
    values[0, 0] = 0.0
    return values.astype(NUMPY[dtype]).astype(np.float64)


def check_against_exact(vectors: np.ndarray, factor: int, objective: str, dtype: str):
    req = GradientRequest(vectors=vectors, factor=factor, objective=objective, offset=OFFSET,
                          outputs=("blocks", "accumulated", "losses"), dtype=dtype)
    exact, exact_accumulated = exact_answer(vectors, factor, objective)
    overflows = not all(representable(loss, dtype) and all(representable(g, dtype) for g in grad)
                        for loss, grad in exact) or not all(representable(a, dtype) for row in exact_accumulated
                                                            for a in row)
    try:
        result = run(req, Settings(device="cpu"), Deadline(60))
    except BlockgradError as error:
        assert error.code == "non_finite_result" and overflows, "refused an answer the dtype holds"
        return
    assert not overflows, "a 200 for an answer the dtype cannot hold"
    blocks = list(result.blocks())
    assert len(blocks) == len(exact) == factor * factor
    for block, (loss, grad) in zip(blocks, exact, strict=True):
        where = f"{objective} {dtype} block ({block.r}, {block.c})"
        assert_near_exact(float(block.loss), loss, dtype, where + " loss")
        for actual, expected in zip(block.gradient.reshape(-1).tolist(), grad, strict=True):
            assert_near_exact(actual, expected, dtype, where + " gradient")
    assert tuple(result.accumulated.shape) == vectors.shape
    for actual_row, exact_row in zip(result.accumulated.tolist(), exact_accumulated, strict=True):
        for actual, expected in zip(actual_row, exact_row, strict=True):
            assert_near_exact(actual, expected, dtype, f"{objective} {dtype} accumulated")


@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("dtype,scale", CASES)
def test_every_objective_is_exact_or_refused_at_both_ends_of_the_range(dtype, scale, objective):
    check_against_exact(scaled_vectors(dtype, scale, seed=int(abs(np.log10(scale)))), 2, objective, dtype)


@pytest.mark.parametrize("dtype,value", [("float32", 1e-45), ("float32", 1e-42), ("float32", 1e-40),
                                         ("float64", 1e-320)])
def test_l2_norm_of_subnormal_inputs_is_exact(dtype, value):
    # The request: {"vectors": [[0,0],[0,0],[0,0],[0,1e-45]], "factor": 2, "objective": "l2_norm"}
    vectors = np.array([[0, 0], [0, 0], [0, 0], [0, value]], dtype=NUMPY[dtype]).astype(np.float64)
    req = GradientRequest(vectors=vectors, factor=2, objective="l2_norm", offset=OFFSET,
                          outputs=("blocks", "accumulated"), dtype=dtype)
    blocks = {(b.r, b.c): b for b in run(req, Settings(device="cpu"), Deadline(60)).blocks()}
    # Block (1, 1) holds the value 4 times: gradient 1/2 there; block (0, 1) twice: 1/sqrt(2).
    assert sorted(set(blocks[1, 1].gradient.reshape(-1).tolist())) == [0.0, 0.5]
    zero, root_half = sorted(set(blocks[0, 1].gradient.reshape(-1).tolist()))
    assert zero == 0.0
    assert_matches([root_half], [2 ** -0.5], dtype, what="gradient of block (0, 1)")
    check_against_exact(vectors, 2, "l2_norm", dtype)


@pytest.mark.parametrize("dtype,value", [("float32", 1e-45), ("float32", 1e-42), ("float32", 1e-40),
                                         ("float64", 1e-320)])
def test_l2_norm_of_many_subnormal_inputs_is_exact(dtype, value):
    # The issue measured 64 x 16 vectors with F = 2; 12 x 3 keeps the exact reference quick.
    vectors = (np.random.default_rng(11).standard_normal((12, 3)) * value).astype(NUMPY[dtype]).astype(np.float64)
    assert np.count_nonzero(vectors) > 12
    check_against_exact(vectors, 2, "l2_norm", dtype)
