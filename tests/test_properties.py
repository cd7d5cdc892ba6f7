"""Property-based: any vectors and factors get a correct 200 or a clean 4xx, never a 5xx.

Bodies are written by hand so that NaN and infinities reach the server the ways a
client can send them: as literal tokens (`NaN`, `Infinity`: not JSON, 400) or as
numbers beyond float64 (`1e400`: 422).
"""
import json
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from app import create_app

from tools.reference import (REFERENCE_OBJECTIVES, SHIFTED_OBJECTIVES, batch_matrix, concat_matrix,
                             reference_accumulated, reference_blocks)
from .numeric import assert_matches, loss_terms
from .test_api import strict_json

OBJECTIVES = ["sum", "mean", "sum_of_squares", "l2_norm", "logsumexp"]
DTYPES = {"float32": torch.float32, "float64": torch.float64}
# Against a float64 oracle: float32's rounding over sums of up to a few hundred terms.
RTOL = {torch.float32: 1e-4, torch.float64: 1e-9}

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
    "outputs": st.one_of(st.lists(st.sampled_from(["blocks", "accumulated", "losses"]), min_size=1, max_size=3),
                         st.lists(st.text(max_size=3), max_size=2), junk),
    "dtype": st.one_of(st.sampled_from(list(DTYPES)), st.text(max_size=4)),
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


@pytest.fixture(scope="module")
def client():
    return create_app({"TESTING": True}).test_client()


def oracle_blocks(vectors: torch.Tensor, factor: int, objective: str, offset: float):
    """(loss, gradient) per block, right where the literal loop is not: float64, logsumexp
    max-shifted, and l2_norm per block on B / 2**e (e from max|B|: exact, and the norm's
    gradient does not change with scale, its value scales back), since the literal
    sqrt(sum(B * B)) underflows for tiny blocks; 0 for an all-zero block, as the contract
    says ("gradient 0 where the norm is 0"), where the literal one is NaN."""
    if objective != "l2_norm":
        return reference_blocks(vectors, factor, objective, offset, objectives=SHIFTED_OBJECTIVES)
    out = []
    for block in batch_matrix(concat_matrix(vectors), factor=factor):
        largest = block.abs().max().item()
        if largest == 0:
            out.append((torch.zeros((), dtype=block.dtype), torch.zeros_like(block)))
            continue
        scale = 2.0 ** math.frexp(largest)[1]
        leaf = (block / scale).detach().requires_grad_(True)
        loss = REFERENCE_OBJECTIVES["l2_norm"](leaf, offset)
        loss.backward()
        out.append((loss.detach() * scale, leaf.grad))
    return out


def oracle_accumulated(vectors: torch.Tensor, factor: int, objective: str, offset: float, blocks) -> torch.Tensor:
    """The literal shared-graph loop; for l2_norm each block's loss replaced by sum(B * G) with G
    its oracle gradient, so that the loop carries exactly those gradients back onto V."""
    if objective != "l2_norm":
        return reference_accumulated(vectors, factor, objective, offset, objectives=SHIFTED_OBJECTIVES)
    leaf = vectors.clone().requires_grad_(True)
    for block, (_, grad) in zip(batch_matrix(concat_matrix(leaf), factor=factor), blocks, strict=True):
        (block * grad).sum().backward(retain_graph=True)
    return leaf.grad


def assert_matches_reference(request: dict, body: dict) -> None:
    dtype = DTYPES[request.get("dtype", "float32")]
    # The service's inputs (rounded to the request's dtype), then the oracle in float64.
    vectors = torch.tensor(request["vectors"], dtype=torch.float64).to(dtype).to(torch.float64)
    n = vectors.shape[0]
    factor = request.get("factor", max(1, math.ceil(n / 6)))
    objective = request.get("objective", "sum")
    offset = torch.tensor(request.get("offset", 5.0), dtype=torch.float64).to(dtype).item()  # as the service rounds it
    outputs = set(request.get("outputs", ["blocks", "accumulated"]))
    assert (body["n"], body["dim"], body["factor"]) == (n, vectors.shape[1], factor)
    assert set(body) - {"n", "dim", "factor", "bounds", "objective", "dtype", "device"} == outputs
    expected = oracle_blocks(vectors, factor, objective, offset)
    assert len(expected) == factor * factor
    if "losses" in body:
        losses = np.array(body["losses"], dtype=np.float64)
        assert losses.shape == (factor, factor)
        blocks = batch_matrix(concat_matrix(vectors), factor=factor)
        scale = [loss_terms(b, objective, offset) for b in blocks]
        assert_matches(losses.reshape(-1), [loss.item() for loss, _ in expected], dtype, scale=np.array(scale),
                       rtol=RTOL[dtype], what="losses")
    if "blocks" in body:
        assert len(body["blocks"]) == factor * factor
        for k, (block, (_, grad)) in enumerate(zip(body["blocks"], expected, strict=True)):
            assert (block["row"], block["col"]) == divmod(k, factor)
            assert_matches(np.array(block["gradient"], dtype=np.float64), grad, dtype, rtol=RTOL[dtype],
                           what=f"block {k} gradient")
    if "accumulated" in body:
        assert_matches(np.array(body["accumulated"], dtype=np.float64),
                       oracle_accumulated(vectors, factor, objective, offset, expected), dtype, rtol=RTOL[dtype],
                       what="accumulated")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(request=requests_, non_finite=st.sampled_from(["literal", "overflow"]))
def test_any_request_gets_a_correct_200_or_a_clean_4xx(client, request, non_finite):
    response = client.post("/v1/gradients", data=encode(request, non_finite),
                           headers={"Content-Type": "application/json"})
    event(f"status {response.status_code}")
    assert response.status_code < 500, response.get_data()
    body = strict_json(response.get_data())  # a strict parser: no NaN or Infinity anywhere
    if response.status_code == 200:
        assert_matches_reference(request, body)
    else:
        assert 400 <= response.status_code < 500
        assert set(body) == {"error"} and isinstance(body["error"]["code"], str)
        assert isinstance(body["error"]["message"], str)


@st.composite
def valid_requests(draw):
    """Well-formed requests, so that many answers are 200s compared with the reference."""
    n, d = draw(st.integers(1, 7)), draw(st.integers(1, 3))
    values = st.one_of(st.floats(-1e3, 1e3), st.floats(-1e-30, 1e-30), st.integers(-1000, 1000))
    request = {"vectors": draw(st.lists(st.lists(values, min_size=d, max_size=d), min_size=n, max_size=n)),
               "objective": draw(st.sampled_from(OBJECTIVES)),
               "outputs": draw(st.lists(st.sampled_from(["blocks", "accumulated", "losses"]), min_size=1, max_size=3)),
               "dtype": draw(st.sampled_from(list(DTYPES))),
               "offset": draw(st.floats(-100, 100))}
    if draw(st.booleans()):
        request["factor"] = draw(st.integers(1, n))
    return request


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(request=valid_requests())
def test_valid_requests_match_the_reference(client, request):
    response = client.post("/v1/gradients", data=json.dumps(request), headers={"Content-Type": "application/json"})
    event(f"status {response.status_code}")
    assert response.status_code in (200, 422), response.get_data()  # 422: a float32 overflow
    body = strict_json(response.get_data())
    if response.status_code == 200:
        assert_matches_reference(request, body)
    else:
        assert body["error"]["code"] == "non_finite_result"


# ---------------------------------------------------------------- the oracle itself: right, and able to fail

ALL_OUTPUTS = ["blocks", "accumulated", "losses"]
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


def service_answer(client, request):
    response = client.post("/v1/gradients", json=request)
    assert response.status_code == 200, response.get_data()
    return strict_json(response.get_data())


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("edge", EDGE_REQUESTS, ids=["logsumexp-overflow", "l2-zero-block", "l2-tiny", "mean-37"])
def test_oracle_accepts_the_services_answers_at_the_edges(client, edge, dtype):
    request = dict(edge, dtype=dtype, outputs=ALL_OUTPUTS)
    assert_matches_reference(request, service_answer(client, request))


def test_tiny_logsumexp_gradient_is_not_zero_and_the_literal_loop_says_0():
    """Why the oracle is not the literal loop here: its float32 gradient is 0 (or NaN), the true one 9.6e-23."""
    vectors = torch.tensor([[100.0, 50.0]])
    (_, literal), = reference_blocks(vectors, 1, "logsumexp")
    (_, oracle), = oracle_blocks(vectors.double(), 1, "logsumexp", 5.0)
    assert not (literal[0, 0, 1] > 0)
    assert oracle[0, 0, 1].item() == pytest.approx(math.exp(-50) / 2, rel=1e-12)


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
        yield "a block missing", changed(lambda b: b["blocks"].pop())
    if "accumulated" in body:
        yield "accumulated +0.1%", changed(lambda b: scale_first(b["accumulated"], 1.001))
        yield "accumulated missing", changed(lambda b: b.pop("accumulated"))
    if "losses" in body:
        yield "loss +0.1%", changed(lambda b: scale_first(b["losses"], 1.001))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("edge", EDGE_REQUESTS, ids=["logsumexp-overflow", "l2-zero-block", "l2-tiny", "mean-37"])
def test_oracle_rejects_a_wrong_answer(client, edge, dtype):
    request = dict(edge, dtype=dtype, outputs=ALL_OUTPUTS)
    body = service_answer(client, request)
    for what, wrong in perturbations(body):
        with pytest.raises(AssertionError):
            assert_matches_reference(request, wrong)
            pytest.fail(f"the oracle passed a wrong answer: {what}")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_oracle_rejects_zero_for_the_tiny_logsumexp_gradient(client, dtype):
    request = dict(EDGE_REQUESTS[0], dtype=dtype, outputs=ALL_OUTPUTS)
    body = service_answer(client, request)
    assert body["blocks"][0]["gradient"][0][0][1] > 0
    body["blocks"][0]["gradient"][0][0][1] = 0.0  # what the literal float32 loop would say
    with pytest.raises(AssertionError, match="block 0 gradient"):
        assert_matches_reference(request, body)
    body = service_answer(client, request)
    body["accumulated"][0][1] = 0.0
    with pytest.raises(AssertionError, match="accumulated"):
        assert_matches_reference(request, body)
