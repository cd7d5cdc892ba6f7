"""The oracle of /v1/gradients: what any request must get, decided without the service.

Its numbers are a literal computation in long double (tools/reference.py's loops written out
again in numpy, a range past 1e4900 and a 64-bit mantissa), independent of the service and
wider than both dtypes. From it each request has one verdict:

- invalid (a NaN or Infinity token: 400 bad_json; a field breaking its rule: 422
  validation_error naming only fields that break one);
- valid and finite in its dtype: 200 and every number equal to the oracle's under
  tests/numeric.py's policy;
- valid and overflowing: 422 non_finite_result, naming the first block that overflows;
- borderline (within the policy's tolerance of the dtype's largest number, or a `sum` whose
  terms' magnitudes overflow before they cancel): either of the two above.
"""
import math
from dataclasses import dataclass

import numpy as np
import pytest

from .numeric import RTOL, assert_matches
from .test_api import strict_json

OBJECTIVES = ("sum", "mean", "sum_of_squares", "l2_norm", "logsumexp")
DTYPES = ("float32", "float64")
OUTPUTS = ("blocks", "accumulated", "losses")
FIELDS = ("vectors", "factor", "objective", "offset", "outputs", "dtype")
HEAD = {"n", "dim", "factor", "bounds", "objective", "dtype", "device"}
WIDE = np.longdouble
WIDE_ENOUGH = np.finfo(WIDE).maxexp > np.finfo(np.float64).maxexp


@dataclass(frozen=True)
class Oracle:
    bounds: list[int]
    losses: np.ndarray  # (F, F)
    terms: np.ndarray  # (F, F): how big the terms each loss sums are (numeric.py's `scale`)
    gradients: list  # F * F arrays (rows, cols, 2D), row-block-major
    accumulated: np.ndarray  # (N, D)


def block_answer(objective: str, block: np.ndarray, offset):
    """(loss, gradient, size of the loss's terms) of one block (h, w, 2D), literally, in long double.
    logsumexp is max-shifted (exp(3e38) is past any range); l2_norm's gradient is 0 where the
    norm is 0, as the contract says."""
    count = block.size
    if objective == "sum":
        terms = block + offset
        return terms.sum(), np.ones_like(block), np.abs(terms).sum()
    if objective == "mean":
        return block.sum() / count, np.full_like(block, 1 / WIDE(count)), np.abs(block).sum() / count
    if objective == "sum_of_squares":
        loss = (block * block).sum()
        return loss, 2 * block, loss
    if objective == "l2_norm":
        norm = np.sqrt((block * block).sum())
        return norm, (block / norm if norm > 0 else np.zeros_like(block)), norm
    if objective == "logsumexp":
        largest = block.max()
        weights = np.exp(block - largest)
        return largest + np.log(weights.sum()), weights / weights.sum(), abs(largest) + np.log(WIDE(count))
    raise ValueError(objective)


def oracle(vectors: np.ndarray, factor: int, objective: str, offset) -> Oracle:
    """Every loss, block gradient and the accumulated gradient; `vectors` and `offset` as the
    service holds them (rounded to the request's dtype). Entry [i, j] of a block is
    concat(V[its row i], V[its column j]); the last block row and column take the remainder."""
    if not WIDE_ENOUGH:
        pytest.skip("the oracle needs a long double wider than float64 (x86-64 or aarch64 Linux)")
    v = np.asarray(vectors, dtype=WIDE)
    n, d = v.shape
    base = n // factor
    bounds = [k * base for k in range(factor)] + [n]
    losses, terms = np.empty((factor, factor), WIDE), np.empty((factor, factor), WIDE)
    gradients, accumulated = [], np.zeros_like(v)
    for r in range(factor):
        rows = slice(bounds[r], bounds[r + 1])
        for c in range(factor):
            cols = slice(bounds[c], bounds[c + 1])
            h, w = rows.stop - rows.start, cols.stop - cols.start
            block = np.concatenate([np.broadcast_to(v[rows, None, :], (h, w, d)),
                                    np.broadcast_to(v[None, cols, :], (h, w, d))], axis=2)
            losses[r, c], gradient, terms[r, c] = block_answer(objective, block, WIDE(offset))
            gradients.append(gradient)
            accumulated[rows] += gradient[:, :, :d].sum(axis=1)
            accumulated[cols] += gradient[:, :, d:].sum(axis=0)
    return Oracle(bounds, losses, terms, gradients, accumulated)


def held(request: dict) -> tuple[np.ndarray, float]:
    """A valid request's vectors and offset as the service holds them: rounded to its dtype."""
    dtype = request.get("dtype", "float32")
    vectors = np.array(request["vectors"], dtype=np.float64).astype(dtype)
    return vectors, float(np.float64(request.get("offset", 5.0)).astype(dtype))


def request_oracle(request: dict) -> Oracle:
    vectors, offset = held(request)
    factor = request.get("factor", max(1, math.ceil(len(vectors) / 6)))
    return oracle(vectors, factor, request.get("objective", "sum"), offset)


def verdict(o: Oracle, dtype: str, objective: str) -> tuple[str, dict | None]:
    """("finite" | "overflows" | "borderline", the details a refusal must give, or None where
    the first block that is not finite is borderline). Every loss and gradient counts, asked
    for or not (the contract: "a loss or gradient overflows dtype")."""
    top = WIDE(np.finfo(dtype).max)
    low, high = top * (1 - WIDE(RTOL[dtype])), top * (1 + WIDE(RTOL[dtype]))

    def judge(size) -> str:
        return "overflows" if size > high else "finite" if size < low else "borderline"

    def block(k: int) -> str:
        own = judge(max(abs(o.losses.flat[k]), np.abs(o.gradients[k]).max()))
        if own == "finite" and objective == "sum" and judge(o.terms.flat[k]) != "finite":
            return "borderline"  # terms summed in dtype may overflow before they cancel
        return own

    blocks = [block(k) for k in range(len(o.gradients))]
    every = blocks + [judge(np.abs(o.accumulated).max())]
    outcome = "overflows" if "overflows" in every else "borderline" if "borderline" in every else "finite"
    first = next((k for k, b in enumerate(blocks) if b != "finite"), None)
    if outcome == "finite":
        details = None
    elif first is None:
        details = {"output": "accumulated"}
    else:
        factor = len(o.bounds) - 1
        details = {"block": dict(zip(("row", "col"), divmod(first, factor), strict=True))} \
            if blocks[first] == "overflows" else None
    return outcome, details


def expected(values, dtype: str) -> np.ndarray:
    """The oracle's numbers as float64 for numeric.py; a borderline one past the dtype's largest
    (a 200 may round it down) held to that largest."""
    top = np.finfo(dtype).max
    return np.clip(np.asarray(values, dtype=WIDE), -top, top).astype(np.float64)


def assert_matches_oracle(request: dict, body: dict, o: Oracle) -> None:
    dtype = request.get("dtype", "float32")
    f = len(o.bounds) - 1
    outputs = set(request.get("outputs", ["blocks", "accumulated"]))
    assert (body["n"], body["dim"], body["factor"], body["bounds"]) == (*o.accumulated.shape, f, o.bounds)
    assert (body["objective"], body["dtype"]) == (request.get("objective", "sum"), dtype)
    assert set(body) - HEAD == outputs
    if "losses" in body:
        assert_matches(np.array(body["losses"], dtype=np.float64), expected(o.losses, dtype), dtype,
                       scale=expected(o.terms, dtype), what="losses")
    if "blocks" in body:
        assert len(body["blocks"]) == f * f
        for k, (block, gradient) in enumerate(zip(body["blocks"], o.gradients, strict=True)):
            r, c = divmod(k, f)
            assert (block["row"], block["col"], block["rows"], block["cols"]) == (
                r, c, o.bounds[r:r + 2], o.bounds[c:c + 2])
            assert_matches(np.array(block["gradient"], dtype=np.float64), expected(gradient, dtype), dtype,
                           what=f"block {k} gradient")
            assert_matches([block["loss"]], expected([o.losses[r, c]], dtype), dtype,
                           scale=expected([o.terms[r, c]], dtype), what=f"block {k} loss")
    if "accumulated" in body:
        assert_matches(np.array(body["accumulated"], dtype=np.float64), expected(o.accumulated, dtype), dtype,
                       what="accumulated")


# ---------------------------------------------------------------- what a request must get


def floats_in(value):
    if isinstance(value, float):
        yield value
    elif isinstance(value, list):
        for item in value:
            yield from floats_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from floats_in(item)


def as_matrix(value) -> np.ndarray | None:
    """The (N, D) float64 matrix a valid `vectors` is, else None: a non-empty list of
    non-empty rows of one length, of JSON numbers (no booleans), each finite in float64."""
    if type(value) is not list or not value or any(type(row) is not list for row in value):
        return None
    width = len(value[0])
    if width == 0 or any(len(row) != width for row in value):
        return None
    cells = [x for row in value for x in row]
    if any(type(x) not in (int, float) for x in cells):
        return None
    try:
        numbers = [float(x) for x in cells]
    except OverflowError:  # an integer past float64
        return None
    return np.array(numbers).reshape(len(value), width) if all(map(math.isfinite, numbers)) else None


def finite_in(values, dtype) -> bool:
    with np.errstate(over="ignore"):
        return bool(np.isfinite(np.asarray(values, dtype=np.float64).astype(dtype)).all())


def invalid_fields(request: dict) -> set[str]:
    """The fields that break their documented rule (docs, the OpenAPI schema); a factor over N
    counts where N is unknown too (the service may or may not name it then)."""
    bad = set(request) - set(FIELDS)  # unknown fields
    dtype = request.get("dtype", "float32")
    if not (type(dtype) is str and dtype in DTYPES):
        bad.add("dtype")
        dtype = None
    matrix = as_matrix(request.get("vectors"))  # missing: None, not a matrix
    if matrix is None or (dtype and not finite_in(matrix, dtype)):
        bad.add("vectors")
    if "factor" in request:
        factor = request["factor"]
        if not (type(factor) is int and 1 <= factor and (matrix is None or factor <= len(matrix))) or matrix is None:
            bad.add("factor")
    objective = request.get("objective", "sum")
    if not (type(objective) is str and objective in OBJECTIVES):
        bad.add("objective")
    offset = request.get("offset", 5.0)
    try:
        number = type(offset) in (int, float) and math.isfinite(float(offset))
    except OverflowError:
        number = False
    if not number or (dtype and not finite_in(offset, dtype)):
        bad.add("offset")
    outputs = request.get("outputs", ["blocks"])
    if not (type(outputs) is list and outputs and all(type(x) is str and x in OUTPUTS for x in outputs)):
        bad.add("outputs")
    return bad


def refusal(request: dict, non_finite: str = "literal") -> tuple[int, str, set[str]] | None:
    """(status, code, the fields it may name) for an invalid request; None for a valid one."""
    tokens = [x for x in floats_in(request) if math.isnan(x) or (non_finite == "literal" and math.isinf(x))]
    if tokens:
        return 400, "bad_json", set()
    bad = invalid_fields(request)
    return (422, "validation_error", bad) if bad else None


def assert_answer(request: dict, response, non_finite: str = "literal") -> str:
    """The answer is the one the oracle demands (the module's docstring); returns the verdict."""
    assert response.status_code < 500, response.get_data()
    body = strict_json(response.get_data())  # a strict parser: no NaN or Infinity anywhere
    refused = refusal(request, non_finite)
    if response.status_code != 200:
        assert set(body) == {"error"} and isinstance(body["error"]["message"], str), body
    if refused is not None:
        status, code, fields = refused
        assert (response.status_code, body.get("error", {}).get("code")) == (status, code), body
        if code == "validation_error":
            named = set(body["error"]["details"]["fields"])
            # A subset: the service refuses in stages (the sizes before conversion, a value's fit in
            # dtype after it), naming the first failing stage's fields; docs/api.md promises no more.
            assert named and named <= fields, f"named {named}, broken {fields}"
        return code
    o = request_oracle(request)
    outcome, details = verdict(o, request.get("dtype", "float32"), request.get("objective", "sum"))
    if outcome == "finite" or (outcome == "borderline" and response.status_code == 200):
        assert response.status_code == 200, f"the oracle's answer is finite ({outcome}), got {body}"
        assert_matches_oracle(request, body, o)
    else:
        assert (response.status_code, body.get("error", {}).get("code")) == (422, "non_finite_result"), \
            f"the oracle's answer overflows, got {response.status_code}"
        if details is not None:
            assert body["error"]["details"] == details
    return outcome
