"""The per-worker memory budget (issue 11): every request's peak is predicted from its sizes
and admitted only if it fits beside what the worker already holds; /v2 computes only what
its outputs need; a /v2 JSON header beside binary outputs is streamed, not built whole."""
import numpy as np
import orjson
import pytest

from app import create_app
from app.api.v1.gradients import answer_cost as v1_answer_cost
from app.api.v2.infer import answer_cost as v2_answer_cost
from app.api.v2.infer import RequestedOutput
from app.core.admission import MemoryLedger, predict_peak_bytes
from app.http.settings import Settings
from app.core.request import Sizes
from app.extensions import services_of
from blockgrad_client.infer import binary_infer_request, read_infer_response

from .test_api import GOOD, assert_error

MIB = 2 ** 20
INFER = "/v2/models/blockgrad/infer"


def must_not_run(*args, **kwargs):
    raise AssertionError("computed a request that admission should have refused")


# --- the ledger


def test_ledger_reserves_resizes_and_releases_once():
    ledger = MemoryLedger(100)
    first = ledger.reserve(60)
    with pytest.raises(Exception) as busy:
        ledger.reserve(50)
    assert busy.value.code == "overloaded" and busy.value.retry_after_s >= 1
    assert busy.value.details == {"limit": "BLOCKGRAD_WORKER_MEMORY_BYTES", "value": 50, "reserved": 60,
                                  "allowed": 100}
    with pytest.raises(Exception) as too_big:
        ledger.reserve(101)
    assert too_big.value.code == "limit_exceeded"
    first.resize(30)
    second = ledger.reserve(70)
    assert ledger.reserved == 100
    first.release()
    first.release()  # idempotent: a stream's end and its close both release
    assert ledger.reserved == 70
    with pytest.raises(Exception) as busy:
        second.resize(101)
    assert busy.value.code == "limit_exceeded" and ledger.reserved == 70
    second.release()
    assert ledger.reserved == 0


def test_prediction_grows_with_what_the_request_holds():
    settings = Settings()
    v1 = v1_answer_cost(0, "float32")
    accumulated = predict_peak_bytes(Sizes(512, 64, 16, ("accumulated",), "sum", "float32"), v1, settings)
    blocks = predict_peak_bytes(Sizes(512, 64, 16, ("blocks", "accumulated"), "sum", "float32"), v1, settings)
    f64 = predict_peak_bytes(Sizes(512, 64, 16, ("accumulated",), "sum", "float64"), v1_answer_cost(0, "float64"),
                             settings)
    assert accumulated < blocks and accumulated < f64
    grid = Sizes(1024, 32, 8, ("blocks",), "sum", "float64")  # block_gradients and bounds

    def v2(grid_binary: bool, bounds_binary: bool):
        outputs = (RequestedOutput("block_gradients", grid_binary), RequestedOutput("bounds", bounds_binary))
        return v2_answer_cost("float64", outputs, 0, binary_input=True)

    binary = predict_peak_bytes(grid, v2(True, True), settings)
    all_json = predict_peak_bytes(grid, v2(False, False), settings)
    mixed = predict_peak_bytes(grid, v2(False, True), settings)
    whole_grid = 1024 * 1024 * 64 * 8
    # Made a block row (128 of 1024 rows) at a time, except as JSON beside binary outputs: held whole.
    assert mixed - binary >= whole_grid and mixed - all_json >= whole_grid - 4 * 1024 * 1024


# --- admission


def test_v1_over_the_budget_is_413_before_computing(monkeypatch):
    client = create_app({"TESTING": True, "BLOCKGRAD_WORKER_MEMORY_BYTES": str(120 * MIB)}).test_client()
    monkeypatch.setattr("app.http.pipeline.run", must_not_run)
    vectors = np.zeros((700, 64)).tolist()
    response = client.post("/v1/gradients", json={"vectors": vectors, "factor": 4, "dtype": "float64",
                                                 "objective": "logsumexp", "outputs": ["blocks", "accumulated"]})
    error = assert_error(response, 413, "limit_exceeded")
    details = error["details"]
    assert details["limit"] == "BLOCKGRAD_WORKER_MEMORY_BYTES" and details["allowed"] == 120 * MIB
    assert details["value"] > details["allowed"]


def test_v2_grid_over_the_budget_is_413_before_computing(monkeypatch):
    client = create_app({"TESTING": True, "BLOCKGRAD_WORKER_MEMORY_BYTES": str(300 * MIB)}).test_client()
    monkeypatch.setattr("app.http.pipeline.run", must_not_run)
    body, headers = binary_infer_request(np.zeros((1024, 32)), {"factor": 8, "objective": "logsumexp"},
                                         ["block_gradients", "bounds"])
    response = client.post(INFER, data=body, headers=headers)
    assert response.status_code == 413
    assert response.headers["X-Blockgrad-Error-Code"] == "limit_exceeded"
    assert "BLOCKGRAD_WORKER_MEMORY_BYTES" in orjson.loads(response.get_data())["error"]


def test_a_body_that_cannot_fit_is_refused_before_it_is_read():
    client = create_app({"TESTING": True, "BLOCKGRAD_WORKER_MEMORY_BYTES": str(40 * MIB)}).test_client()
    body = orjson.dumps({"vectors": [[0.0] * 64] * 8000})  # ~2.6 MB of JSON numbers
    error = assert_error(client.post("/v1/gradients", data=body, content_type="application/json"),
                         413, "limit_exceeded")
    assert error["details"]["limit"] == "BLOCKGRAD_WORKER_MEMORY_BYTES"


def test_only_the_current_load_in_the_way_is_503_overloaded_then_served():
    app = create_app({"TESTING": True})
    client = app.test_client()
    ledger = services_of(app).ledger
    held = ledger.reserve(ledger.budget - 1024)  # another request's reservation
    response = client.post("/v1/gradients", json=GOOD)
    assert_error(response, 503, "overloaded")
    assert int(response.headers["Retry-After"]) >= 1
    held.release()
    served = client.post("/v1/gradients", json=GOOD)
    assert served.status_code == 200
    served.get_data()
    served.close()
    assert ledger.reserved == 0  # the served request gave its reservation back once written


def test_a_streamed_answer_holds_its_reservation_until_written():
    app = create_app({"TESTING": True})
    ledger = services_of(app).ledger
    streamed = dict(GOOD, vectors=np.ones((64, 2)).tolist())  # over WHOLE_ANSWER_NUMBERS: blocks stream
    response = app.test_client().post("/v1/gradients", json=streamed, buffered=False)
    assert response.status_code == 200 and response.is_streamed
    assert ledger.reserved > 0
    b"".join(response.response)
    response.close()
    assert ledger.reserved == 0


def test_errors_release_the_reservation(client, app):
    assert_error(client.post("/v1/gradients", json={"vectors": [[1.0]], "factor": 2}), 422, "validation_error")
    assert services_of(app).ledger.reserved == 0


# --- /v2 computes only what its outputs need


def test_v2_bounds_alone_computes_no_block(monkeypatch):
    client = create_app({"TESTING": True}).test_client()
    monkeypatch.setattr("app.http.pipeline.run", must_not_run)
    body, headers = binary_infer_request(np.zeros((8192, 2), dtype=np.float32), {"factor": 8192}, ["bounds"])
    response = client.post(INFER, data=body, headers=headers)
    assert response.status_code == 200
    _, tensors = read_infer_response(response.get_data(), response.headers)
    assert tensors["bounds"].tolist() == list(range(8192)) + [8192]  # base 1: one row per block


# --- a JSON header beside binary outputs is streamed, and its length is exact


def test_mixed_json_and_binary_outputs_match_the_all_json_answer(client):
    vectors = np.random.default_rng(3).standard_normal((40, 3))
    body, headers = binary_infer_request(vectors, {"factor": 3, "objective": "logsumexp"},
                                         ["block_gradients", "bounds", "losses"], binary_output=False)
    end = int(headers["Inference-Header-Content-Length"])
    document = orjson.loads(body[:end])
    document["outputs"] = [{"name": "block_gradients", "parameters": {"binary_data": False}},
                           {"name": "bounds", "parameters": {"binary_data": True}},
                           {"name": "losses", "parameters": {"binary_data": True}}]
    header = orjson.dumps(document)
    mixed = client.post(INFER, data=header + body[end:],
                        headers={**headers, "Inference-Header-Content-Length": str(len(header))})
    assert mixed.status_code == 200
    data = mixed.get_data()
    assert len(data) == int(mixed.headers["Content-Length"])
    length = int(mixed.headers["Inference-Header-Content-Length"])
    orjson.loads(data[:length])  # exactly the JSON header, nothing more or less
    _, tensors = read_infer_response(data, mixed.headers)
    all_json = client.post(INFER, data=body, headers=headers)
    _, expected = read_infer_response(all_json.get_data(), all_json.headers)
    for name in ("block_gradients", "bounds", "losses"):
        np.testing.assert_array_equal(tensors[name], expected[name])


def test_a_body_at_the_size_limit_fits_the_default_budget():
    # A body at the size limit, once it has arrived, reserves its parse estimate: that must fit.
    from app.core.admission import body_parse_bytes

    settings = Settings()
    assert body_parse_bytes(settings.max_body_bytes, binary=False) <= settings.worker_memory_bytes
