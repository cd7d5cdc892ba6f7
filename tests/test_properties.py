"""Property-based: every request gets the answer the oracle says it must, never a 5xx.

The oracle is a literal computation in long double (tools/reference.py's loops written out
again in numpy, a range past 1e4900 and a 64-bit mantissa), independent of the service and
wider than both dtypes. From it each request has one verdict:

- invalid (a NaN or Infinity token: 400 bad_json; a field breaking its rule: 422
  validation_error naming only fields that break one);
- valid and finite in its dtype: 200 and every number equal to the oracle's under
  tests/numeric.py's policy;
- valid and overflowing: 422 non_finite_result, naming the first block that overflows;
- borderline (within the policy's tolerance of the dtype's largest number, or a `sum` whose
  terms' magnitudes overflow before they cancel): either of the two above.

So a pipeline that refuses every request, or answers a wrong number, fails here.
Bodies are written by hand so that NaN and infinities reach the server the ways a client
can send them: as literal tokens (`NaN`, `Infinity`: not JSON, 400) or as numbers beyond
float64 (`1e400`: 422).
"""
import json
import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from app import create_app
from app.core.errors import non_finite_block

from tools.reference import SHIFTED_OBJECTIVES, reference_accumulated, reference_blocks
from .numeric import RTOL, assert_matches
from .test_api import strict_json

OBJECTIVES = ("sum", "mean", "sum_of_squares", "l2_norm", "logsumexp")
DTYPES = ("float32", "float64")
OUTPUTS = ("blocks", "accumulated", "losses")
HEAD = {"n", "dim", "factor", "bounds", "objective", "dtype", "device"}
WIDE = np.longdouble
PROPERTY = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

if np.finfo(WIDE).maxexp <= np.finfo(np.float64).maxexp:
    pytest.skip("the oracle needs a long double wider than float64 (x86-64 or aarch64 Linux)",
                allow_module_level=True)


@pytest.fixture(scope="module")
def client():
    return create_app({"TESTING": True}).test_client()


# ---------------------------------------------------------------- the oracle

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
    bad = set()
    dtype = request.get("dtype", "float32")
    if not (type(dtype) is str and dtype in DTYPES):
        bad.add("dtype")
        dtype = None
    matrix = as_matrix(request["vectors"])
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


# ---------------------------------------------------------------- any request at all

any_float = st.floats(allow_nan=True, allow_infinity=True)  # huge, tiny, subnormal, NaN, inf
finite_float = st.one_of(st.floats(-1e6, 1e6), st.floats(allow_nan=False, allow_infinity=False))
junk = st.one_of(st.text(max_size=3), st.booleans(), st.none(), st.integers(-10 ** 400, 10 ** 400),
                 st.lists(st.floats(), max_size=2), st.dictionaries(st.text(max_size=2), st.integers(), max_size=1))


@st.composite
def matrices(draw):
    """Mostly rectangular matrices of finite floats; sometimes anything at all."""
    n, d = draw(st.integers(1, 6)), draw(st.integers(1, 3))
    kind = draw(st.sampled_from(["finite", "finite", "finite", "any_float", "ragged", "junk"]))
    if kind == "finite":
        return draw(st.lists(st.lists(finite_float, min_size=d, max_size=d), min_size=n, max_size=n))
    if kind == "any_float":
        return draw(st.lists(st.lists(any_float, min_size=d, max_size=d), min_size=n, max_size=n))
    if kind == "ragged":
        return draw(st.lists(st.lists(finite_float, max_size=4), max_size=6))
    return draw(st.one_of(junk, st.lists(st.one_of(junk, st.lists(st.one_of(finite_float, junk), max_size=3)),
                                         max_size=4)))


requests_ = st.fixed_dictionaries({"vectors": matrices()}, optional={
    "factor": st.one_of(st.integers(-1, 8), st.floats(), st.text(max_size=2), st.booleans(), st.none()),
    "objective": st.one_of(st.sampled_from(OBJECTIVES), st.text(max_size=4)),
    "offset": st.one_of(finite_float, any_float, junk),
    "outputs": st.one_of(st.lists(st.sampled_from(OUTPUTS), min_size=1, max_size=3),
                         st.lists(st.text(max_size=3), max_size=2), junk),
    "dtype": st.one_of(st.sampled_from(DTYPES), st.text(max_size=4)),
})


def encode(value, non_finite: str) -> str:
    """JSON text; non-finite floats as literal tokens or as out-of-range numbers."""
    if isinstance(value, float) and not math.isfinite(value):
        if non_finite == "overflow" and not math.isnan(value):
            return "1e400" if value > 0 else "-1e400"
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, list):
        return "[" + ",".join(encode(v, non_finite) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(json.dumps(k) + ":" + encode(v, non_finite) for k, v in value.items()) + "}"
    return json.dumps(value)


def post(client, request: dict, non_finite: str = "literal"):
    return client.post("/v1/gradients", data=encode(request, non_finite), headers={"Content-Type": "application/json"})


@settings(max_examples=150, **PROPERTY)
@given(request=requests_, non_finite=st.sampled_from(["literal", "overflow"]))
def test_any_request_gets_the_answer_the_oracle_demands(client, request, non_finite):
    event(assert_answer(request, post(client, request, non_finite), non_finite))


# ---------------------------------------------------------------- valid requests: 200 and exact, or an overflow

@st.composite
def valid_requests(draw):
    """Well-formed requests, values from moderate to the dtype's largest, so that both verdicts come up."""
    dtype = draw(st.sampled_from(DTYPES))
    top, width = float(np.finfo(dtype).max), 32 if dtype == "float32" else 64
    n, d = draw(st.integers(1, 7)), draw(st.integers(1, 3))

    def floats(bound):  # bounds held in the dtype, as hypothesis wants them
        bound = float(np.float64(bound).astype(dtype))
        return st.floats(-bound, bound, width=width)

    moderate = st.one_of(floats(1e3), st.integers(-1000, 1000))
    values = draw(st.sampled_from([
        moderate,
        st.one_of(moderate, floats(1e-30)),  # squares underflow float32
        st.one_of(moderate, floats(top)),  # up to the largest: overflows
        floats(math.sqrt(top)),  # squares near the largest
    ]))
    request = {"vectors": draw(st.lists(st.lists(values, min_size=d, max_size=d), min_size=n, max_size=n)),
               "objective": draw(st.sampled_from(OBJECTIVES)),
               "outputs": draw(st.lists(st.sampled_from(OUTPUTS), min_size=1, max_size=3)),
               "dtype": dtype,
               "offset": draw(st.one_of(st.floats(-100, 100), floats(top)))}
    if draw(st.booleans()):
        request["factor"] = draw(st.integers(1, n))
    return request


@settings(max_examples=150, **PROPERTY)
@given(request=valid_requests())
@example(request={"vectors": [[0.5]], "factor": 1, "objective": "l2_norm", "outputs": list(OUTPUTS),
                  "dtype": "float32", "offset": 1.0})  # N = D = F = 1
@example(request={"vectors": [[1.0], [-2.0], [3.5], [0.25], [7.0]], "factor": 5, "objective": "logsumexp",
                  "outputs": list(OUTPUTS), "dtype": "float64", "offset": 0.0})  # F = N, D = 1
@example(request={"vectors": [[1.0, 2.0, 3.0]] * 7, "factor": 1, "objective": "mean", "outputs": list(OUTPUTS),
                  "dtype": "float32", "offset": 0.0})  # F = 1, N = 7
def test_valid_requests_are_answered_exactly_or_refused_only_where_they_overflow(client, request):
    assert refusal(request) is None
    event(assert_answer(request, post(client, request)))


# N, D and F at their edges, each objective and dtype: always finite, so always a 200.
EDGE_SIZES = [(1, 1, 1), (1, 4, 1), (5, 1, 1), (5, 1, 5), (7, 2, 7), (7, 3, 1), (7, 2, 3), (6, 3, 6)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("n,d,f", EDGE_SIZES, ids=[f"N{n}-D{d}-F{f}" for n, d, f in EDGE_SIZES])
def test_sizes_at_their_edges_get_exact_200s(client, n, d, f, objective, dtype):
    rng = np.random.default_rng(n * 100 + d * 10 + f)
    request = {"vectors": rng.uniform(-4, 4, (n, d)).round(3).tolist(), "factor": f, "objective": objective,
               "outputs": list(OUTPUTS), "dtype": dtype, "offset": 1.5}
    assert assert_answer(request, post(client, request)) == "finite"


# Each side of an overflow, with the verdict written out (and the oracle held to it).
OVERFLOW_EDGES = [
    # sum_of_squares of [v, v]: 2 v^2 against the largest (3.4028e38 in float32, 1.7977e308 in float64)
    ({"vectors": [[1.3e19]], "objective": "sum_of_squares", "dtype": "float32"}, "finite", None),
    ({"vectors": [[1.31e19]], "objective": "sum_of_squares", "dtype": "float32"}, "overflows", (0, 0)),
    ({"vectors": [[9.4e153]], "objective": "sum_of_squares", "dtype": "float64"}, "finite", None),
    ({"vectors": [[9.5e153]], "objective": "sum_of_squares", "dtype": "float64"}, "overflows", (0, 0)),
    # its gradient 2v overflows on its own in the second block
    ({"vectors": [[1.0], [1e38]], "objective": "sum_of_squares", "dtype": "float32", "factor": 2},
     "overflows", (0, 1)),
    # a mean of the largest numbers is finite although their sum is not
    ({"vectors": [[3.4e38], [3.4e38]], "objective": "mean", "dtype": "float32", "factor": 1}, "finite", None),
    ({"vectors": [[1.7e308], [-1.7e308], [1.7e308]], "objective": "mean", "dtype": "float64", "factor": 1},
     "finite", None),
    # l2_norm of [v, v] is sqrt(2) v
    ({"vectors": [[1e308]], "objective": "l2_norm", "dtype": "float64"}, "finite", None),
    ({"vectors": [[1.3e308]], "objective": "l2_norm", "dtype": "float64"}, "overflows", (0, 0)),
    ({"vectors": [[2.4e38]], "objective": "l2_norm", "dtype": "float32"}, "finite", None),
    ({"vectors": [[2.5e38]], "objective": "l2_norm", "dtype": "float32"}, "overflows", (0, 0)),
    # logsumexp never overflows: about the largest entry
    ({"vectors": [[3.4e38, -3.4e38]], "objective": "logsumexp", "dtype": "float32"}, "finite", None),
    # sum: 2 (v + offset) per block of [v, v]
    ({"vectors": [[1.7e38]], "objective": "sum", "dtype": "float32", "offset": 0.0}, "finite", None),
    ({"vectors": [[1.71e38]], "objective": "sum", "dtype": "float32", "offset": 0.0}, "overflows", (0, 0)),
]


@pytest.mark.parametrize("outputs", [list(OUTPUTS), ["accumulated"]], ids=["all", "accumulated-only"])
@pytest.mark.parametrize("request_,outcome,block", OVERFLOW_EDGES)
def test_overflow_edges(client, request_, outcome, block, outputs):
    request = dict(request_, outputs=outputs)
    o = request_oracle(request)
    assert verdict(o, request["dtype"], request["objective"]) == (
        outcome, None if block is None else {"block": {"row": block[0], "col": block[1]}})
    response = post(client, request)
    assert response.status_code == (200 if outcome == "finite" else 422), response.get_data()
    assert assert_answer(request, response) == outcome


# ---------------------------------------------------------------- the checks themselves: right, and able to fail

def refuse_everything(*args, **kwargs):
    raise non_finite_block(0, 0, "float32")


def test_a_pipeline_that_refuses_every_request_fails_these_checks(client, monkeypatch):
    """What the old checks let through (any 4xx, or non_finite_result, for a valid request)."""
    monkeypatch.setattr("app.http.pipeline.run", refuse_everything)
    request = {"vectors": [[1.0, 2.0], [3.0, 4.0]], "objective": "sum", "dtype": "float32"}
    response = post(client, request)
    assert (response.status_code, strict_json(response.get_data())["error"]["code"]) == (422, "non_finite_result")
    with pytest.raises(AssertionError, match="finite"):
        assert_answer(request, response)


@pytest.mark.parametrize("request_,fields", [
    ({"vectors": [[1.0]], "factor": 2}, {"factor"}),
    ({"vectors": [[1.0]], "offset": 1e39}, {"offset"}),
    ({"vectors": [[1e39]]}, {"vectors"}),
    ({"vectors": [[1e39]], "dtype": "float64"}, set()),
    ({"vectors": [[True]]}, {"vectors"}),
    ({"vectors": [[1.0], [1.0, 2.0]]}, {"vectors"}),
    ({"vectors": [[]]}, {"vectors"}),
    ({"vectors": [[10 ** 400]], "dtype": "float64"}, {"vectors"}),
    ({"vectors": [[1.0]], "outputs": []}, {"outputs"}),
    ({"vectors": [[1.0]], "outputs": ["blocks", "blocks"]}, set()),
    ({"vectors": [[1.0]], "objective": "x", "offset": True, "factor": 1.0}, {"objective", "offset", "factor"}),
])
def test_invalid_fields_are_the_documented_rules(client, request_, fields):
    """The oracle's rules, each against a literal answer, and the service naming exactly those."""
    assert invalid_fields(request_) == fields
    response = post(client, request_)
    if fields:
        assert response.status_code == 422
        assert set(strict_json(response.get_data())["error"]["details"]["fields"]) == fields
    else:
        assert response.status_code == 200


def test_nan_and_infinity_tokens_are_bad_json_and_1e400_is_a_field_error(client):
    request = {"vectors": [[1.0, math.inf]]}
    assert refusal(request, "literal")[:2] == (400, "bad_json")
    assert refusal(request, "overflow") == (422, "validation_error", {"vectors"})
    assert refusal({"vectors": [[1.0]], "offset": math.nan}, "overflow")[:2] == (400, "bad_json")
    for non_finite in ("literal", "overflow"):
        assert assert_answer(request, post(client, request, non_finite), non_finite) in ("bad_json", "validation_error")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("objective", OBJECTIVES)
def test_oracle_agrees_with_the_literal_reference(objective, dtype):
    """tools/reference.py's loops (float64 torch, logsumexp max-shifted) and this oracle, where both hold."""
    rng = np.random.default_rng(7)
    vectors = rng.uniform(-3, 3, (7, 2)).astype(dtype)
    o = oracle(vectors, 3, objective, 1.5)
    torch_vectors = torch.tensor(vectors, dtype=torch.float64)
    reference = reference_blocks(torch_vectors, 3, objective, 1.5, objectives=SHIFTED_OBJECTIVES)
    for k, ((loss, gradient), mine) in enumerate(zip(reference, o.gradients, strict=True)):
        assert_matches(gradient, expected(mine, "float64"), "float64", what=f"block {k} gradient")
        assert_matches([loss.item()], expected([o.losses.flat[k]], "float64"), "float64",
                       scale=expected([o.terms.flat[k]], "float64"), what=f"block {k} loss")
    accumulated = reference_accumulated(torch_vectors, 3, objective, 1.5, objectives=SHIFTED_OBJECTIVES)
    assert_matches(accumulated, expected(o.accumulated, "float64"), "float64", what="accumulated")


def test_oracle_knows_closed_forms():
    """sum's gradient is 1 everywhere and each entry of V is in 2N pairs; sum_of_squares' is 2B."""
    vectors = np.array([[1.0, -2.0], [0.5, 3.0], [4.0, 0.0]])
    o = oracle(vectors, 2, "sum", 5.0)
    assert all((g == 1).all() for g in o.gradients) and (o.accumulated == 6).all()
    assert o.losses[0, 0] == (1 - 2 + 1 - 2) + 4 * 5  # block (0, 0) is concat(V[0], V[0])
    o = oracle(vectors, 1, "sum_of_squares", 0.0)
    assert (o.accumulated == 4 * 3 * vectors).all()  # 2B in each of 2N = 6 pairs


ALL_OUTPUTS = list(OUTPUTS)
EDGE_REQUESTS = [
    # exp(100) overflows float32: the literal loop's gradient is 0 where the true one is exp(-50) / 2.
    {"vectors": [[100.0, 50.0]], "objective": "logsumexp", "factor": 1},
    # A zero block: the literal sqrt's gradient is NaN there, the contract's is 0.
    {"vectors": [[0.0, 0.0], [1.0, 2.0]], "objective": "l2_norm", "factor": 2},
    # Squares of 1e-30 underflow float32 in the literal form.
    {"vectors": [[1e-30, -3e-30], [2e-30, 5e-31], [1e3, 7.0]], "objective": "l2_norm", "factor": 3},
    # mean at N = 37: gradients of 1.2e-4, which a 2e-5 absolute tolerance cannot tell apart.
    {"vectors": [[float(i % 7) - 3.0, 0.5 * i] for i in range(37)], "objective": "mean", "factor": 2},
]
EDGE_IDS = ["logsumexp-overflow", "l2-zero-block", "l2-tiny", "mean-37"]


def service_answer(client, request):
    response = client.post("/v1/gradients", json=request)
    assert response.status_code == 200, response.get_data()
    return strict_json(response.get_data())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("edge", EDGE_REQUESTS, ids=EDGE_IDS)
def test_oracle_accepts_the_services_answers_at_the_edges(client, edge, dtype):
    request = dict(edge, dtype=dtype, outputs=ALL_OUTPUTS)
    assert assert_answer(request, post(client, request)) == "finite"


def test_tiny_logsumexp_gradient_is_not_zero_and_the_literal_loop_says_0():
    """Why the oracle is not the literal loop here: its float32 gradient is 0 (or NaN), the true one 9.6e-23."""
    vectors = torch.tensor([[100.0, 50.0]])
    (_, literal), = reference_blocks(vectors, 1, "logsumexp")
    o = oracle(vectors.numpy(), 1, "logsumexp", 5.0)
    assert not (literal[0, 0, 1] > 0)
    assert float(o.gradients[0][0, 0, 1]) == pytest.approx(math.exp(-50) / 2, rel=1e-15)


def perturbations(body: dict):
    """(what, a copy of body with one number wrong), one per output and kind of error."""
    def changed(edit):
        wrong = json.loads(json.dumps(body))
        edit(wrong)
        return wrong

    def scale_first(rows, factor):
        while isinstance(rows[0], list):
            rows = rows[0]
        rows[-1] = rows[-1] * factor if rows[-1] != 0 else 1e-3

    if "blocks" in body:
        yield "block gradient +0.1%", changed(lambda b: scale_first(b["blocks"][-1]["gradient"], 1.001))
        yield "block loss +0.1%", changed(lambda b: b["blocks"][0].update(loss=b["blocks"][0]["loss"] * 1.001 + 1e-3))
        yield "a block missing", changed(lambda b: b["blocks"].pop())
        if len(body["blocks"]) > 1:
            yield "blocks swapped", changed(lambda b: b["blocks"].reverse())
    if "accumulated" in body:
        yield "accumulated +0.1%", changed(lambda b: scale_first(b["accumulated"], 1.001))
        yield "accumulated missing", changed(lambda b: b.pop("accumulated"))
    if "losses" in body:
        yield "loss +0.1%", changed(lambda b: scale_first(b["losses"], 1.001))
    yield "bounds off by one", changed(lambda b: b["bounds"].__setitem__(1, b["bounds"][1] + 1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("edge", EDGE_REQUESTS, ids=EDGE_IDS)
def test_oracle_rejects_a_wrong_answer(client, edge, dtype):
    request = dict(edge, dtype=dtype, outputs=ALL_OUTPUTS)
    body = service_answer(client, request)
    o = request_oracle(request)
    for what, wrong in perturbations(body):
        with pytest.raises(AssertionError):
            assert_matches_oracle(request, wrong, o)
            pytest.fail(f"the oracle passed a wrong answer: {what}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_oracle_rejects_zero_for_the_tiny_logsumexp_gradient(client, dtype):
    request = dict(EDGE_REQUESTS[0], dtype=dtype, outputs=ALL_OUTPUTS)
    o = request_oracle(request)
    body = service_answer(client, request)
    assert body["blocks"][0]["gradient"][0][0][1] > 0
    body["blocks"][0]["gradient"][0][0][1] = 0.0  # what the literal float32 loop would say
    with pytest.raises(AssertionError, match="block 0 gradient"):
        assert_matches_oracle(request, body, o)
    body = service_answer(client, request)
    body["accumulated"][0][1] = 0.0
    with pytest.raises(AssertionError, match="accumulated"):
        assert_matches_oracle(request, body, o)
