"""Compute admission (issue 11): what the cost model predicts cannot finish within the
deadline is refused up front with 413, never computed. The cost constants are pinned
(BLOCKGRAD_COST_PER_BLOCK_S / _PER_NUMBER_S), so no verdict depends on this machine."""
import numpy as np
import orjson
import pytest

from app import create_app
from blockgrad_client.infer import binary_infer_request

from .test_api import assert_error

INFER = "/v2/models/blockgrad/infer"
# 1 ms a block: 1000 x 1000 blocks is predicted 1000 s, one block 1 ms.
PINNED = {"TESTING": True, "BLOCKGRAD_COST_PER_BLOCK_S": 1e-3, "BLOCKGRAD_COST_PER_NUMBER_S": 1e-12,
          "BLOCKGRAD_REQUEST_TIMEOUT_S": 60}


def must_not_run(*args, **kwargs):
    raise AssertionError("computed a request that compute admission should have refused")


@pytest.fixture
def pinned(monkeypatch):
    monkeypatch.setattr("app.http.pipeline.run", must_not_run)
    monkeypatch.setattr("app.http.pipeline.run", must_not_run)
    return create_app(PINNED).test_client()


def test_v1_request_predicted_past_the_deadline_is_413_with_prediction_and_deadline(pinned):
    body = {"vectors": np.zeros((1000, 2)).tolist(), "factor": 1000, "outputs": ["losses"]}
    error = assert_error(pinned.post("/v1/gradients", json=body), 413, "limit_exceeded")
    details = error["details"]
    assert details["limit"] == "BLOCKGRAD_REQUEST_TIMEOUT_S" and details["deadline_s"] == 60
    assert details["allowed"] == 60 and details["value"] == details["predicted_s"]
    assert details["predicted_s"] == pytest.approx(1000 * 1000 * 1e-3, rel=0.01)
    assert details["suggested_factor"] == 1  # one block: predicted 1 ms
    assert "predicted" in error["message"]


def test_v2_request_predicted_past_the_deadline_is_413(pinned):
    body, headers = binary_infer_request(np.zeros((1000, 2), dtype=np.float32), {"factor": 1000}, ["losses"])
    response = pinned.post(INFER, data=body, headers=headers)
    assert response.status_code == 413
    assert response.headers["X-Blockgrad-Error-Code"] == "limit_exceeded"
    assert "BLOCKGRAD_REQUEST_TIMEOUT_S" in orjson.loads(response.get_data())["error"]


def test_v2_bounds_alone_is_served_whatever_the_prediction(pinned):
    body, headers = binary_infer_request(np.zeros((1000, 2), dtype=np.float32), {"factor": 1000}, ["bounds"])
    assert pinned.post(INFER, data=body, headers=headers).status_code == 200


def test_a_request_predicted_within_the_deadline_is_served():
    client = create_app(PINNED).test_client()
    body = {"vectors": np.ones((40, 2)).tolist(), "factor": 20, "outputs": ["losses"]}  # 400 blocks: 0.4 s
    response = client.post("/v1/gradients", json=body)
    assert response.status_code == 200
    assert np.array(response.get_json()["losses"]).shape == (20, 20)


def test_no_suggested_factor_when_none_would_finish_in_time(monkeypatch):
    monkeypatch.setattr("app.http.pipeline.run", must_not_run)
    client = create_app({**PINNED, "BLOCKGRAD_COST_PER_BLOCK_S": 100.0}).test_client()  # even one block: 100 s
    error = assert_error(client.post("/v1/gradients", json={"vectors": [[1.0]] * 4, "factor": 2}),
                         413, "limit_exceeded")
    assert "suggested_factor" not in error["details"]
