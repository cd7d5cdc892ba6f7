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

from tools.reference import reference_accumulated, reference_blocks
from .test_api import strict_json

OBJECTIVES = ["sum", "mean", "sum_of_squares", "l2_norm", "logsumexp"]
DTYPES = {"float32": torch.float32, "float64": torch.float64}

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


def assert_matches_reference(request: dict, body: dict) -> None:
    dtype = DTYPES[request.get("dtype", "float32")]
    vectors = torch.tensor(request["vectors"], dtype=torch.float64).to(dtype)
    n = vectors.shape[0]
    factor = request.get("factor", max(1, math.ceil(n / 6)))
    objective, offset = request.get("objective", "sum"), request.get("offset", 5.0)
    assert (body["n"], body["dim"], body["factor"]) == (n, vectors.shape[1], factor)
    tol = 1e-4 if dtype == torch.float32 else 1e-9
    # The literal l2_norm squares its inputs, which underflow for tiny vectors (1e-30 in
    # float32). The norm scales with its input and its gradient does not, so the reference
    # runs on V times a power of two (exact) and its losses are scaled back.
    loss_scale = 1.0
    if objective == "l2_norm":
        largest = vectors.abs().max().item()
        if largest > 0:
            loss_scale = 2.0 ** math.frexp(largest)[1]
            vectors = vectors / loss_scale
    if "blocks" in body or "losses" in body:
        expected = reference_blocks(vectors, factor, objective, offset)
        losses = np.array([loss.item() * loss_scale for loss, _ in expected])
        if "losses" in body:
            assert_close(np.array(body["losses"]).reshape(-1), losses, tol)
        for block, (loss, grad) in zip(body.get("blocks", []), expected):
            assert_close(np.array(block["gradient"]), grad.numpy(), tol)
    if "accumulated" in body:
        assert_close(np.array(body["accumulated"]), reference_accumulated(vectors, factor, objective, offset).numpy(), tol)


def assert_close(actual: np.ndarray, expected: np.ndarray, tol: float) -> None:
    """Equal within a relative tolerance, where the literal reference is itself finite
    (its naive logsumexp overflows and its l2_norm gives NaN at 0, where the service's do not)."""
    assert actual.shape == expected.shape
    assert np.isfinite(actual).all()
    mask = np.isfinite(expected)
    scale = np.abs(expected[mask]).max(initial=0.0)
    np.testing.assert_allclose(actual[mask], expected[mask], rtol=tol, atol=tol * scale + 1e-30)


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
