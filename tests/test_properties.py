"""Property-based: every request gets the answer the oracle (tests/oracle.py) says it must:
200 and exact where the answer is finite in its dtype, 422 non_finite_result only where it
overflows, the exact 4xx code for invalid input, never a 5xx. So a pipeline that refuses
every request, or answers a wrong number, fails here.

Bodies are written by hand so that NaN and infinities reach the server the ways a client
can send them: as literal tokens (`NaN`, `Infinity`: not JSON, 400) or as numbers beyond
float64 (`1e400`: 422).
"""
import json
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from app import create_app
from app.core.errors import non_finite_block

from tools.reference import SHIFTED_OBJECTIVES, reference_accumulated, reference_blocks
from .numeric import assert_matches
from .oracle import (DTYPES, OBJECTIVES, OUTPUTS, WIDE_ENOUGH, assert_answer, assert_matches_oracle, expected,
                     invalid_fields, oracle, refusal, request_oracle, verdict)
from .test_api import strict_json

PROPERTY = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

if not WIDE_ENOUGH:
    pytest.skip("the oracle needs a long double wider than float64 (x86-64 or aarch64 Linux)",
                allow_module_level=True)


@pytest.fixture(scope="module")
def client():
    return create_app({"TESTING": True}).test_client()


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
    assert_matches([float(o.gradients[0][0, 0, 1])], [math.exp(-50) / 2], "float64", what="softmax of [100, 50, 100, 50]")


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
