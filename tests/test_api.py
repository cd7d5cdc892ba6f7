"""/v1/gradients end to end through the Flask test client."""
import json

import numpy as np
import pytest
import torch

from app import create_app

from tools.reference import reference_accumulated, reference_blocks

from .numeric import assert_matches

GOOD = {"vectors": [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], "factor": 2}


def strict_json(data: bytes):
    """Parse as a strict JSON parser would: NaN and Infinity literals are errors."""
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")
    return json.loads(data, parse_constant=refuse)


def post(client, body, **kwargs):
    response = client.post("/v1/gradients", json=body, **kwargs)
    return response, strict_json(response.get_data())


def test_seed_example_end_to_end(client):
    vectors = torch.randn(10, 5).tolist()
    response, body = post(client, {"vectors": vectors})
    assert response.status_code == 200
    assert response.mimetype == "application/json"
    assert body["n"] == 10 and body["dim"] == 5 and body["factor"] == 2
    assert body["bounds"] == [0, 5, 10]
    assert body["objective"] == "sum" and body["dtype"] == "float32" and body["device"] == "cpu"
    assert "losses" not in body
    assert [(b["row"], b["col"], b["rows"], b["cols"]) for b in body["blocks"]] == [
        (0, 0, [0, 5], [0, 5]), (0, 1, [0, 5], [5, 10]), (1, 0, [5, 10], [0, 5]), (1, 1, [5, 10], [5, 10])]
    for block in body["blocks"]:
        assert np.array(block["gradient"]).shape == (5, 5, 10)
        assert np.all(np.array(block["gradient"]) == 1.0)
    assert np.all(np.array(body["accumulated"]) == 20.0)
    assert np.array(body["accumulated"]).shape == (10, 5)


@pytest.mark.parametrize("objective", ["sum", "mean", "sum_of_squares", "l2_norm", "logsumexp"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_api_matches_reference(client, objective, dtype):
    torch_dtype = {"float32": torch.float32, "float64": torch.float64}[dtype]
    vectors = torch.randn(11, 3, dtype=torch.float64)
    response, body = post(client, {"vectors": vectors.tolist(), "factor": 3, "objective": objective,
                                   "offset": 1.5, "dtype": dtype,
                                   "outputs": ["losses", "blocks", "accumulated"]})
    assert response.status_code == 200
    cast = vectors.to(torch_dtype)
    expected = reference_blocks(cast, 3, objective, 1.5)
    assert set(body) == {"n", "dim", "factor", "bounds", "objective", "dtype", "device",
                         "losses", "blocks", "accumulated"}
    assert len(body["blocks"]) == len(expected) == 9
    losses = np.array(body["losses"])
    assert losses.shape == (3, 3)
    for k, (block, (loss, grad)) in enumerate(zip(body["blocks"], expected, strict=True)):
        assert (block["row"], block["col"]) == divmod(k, 3)
        assert_matches(np.array(block["gradient"]), grad, dtype, what=f"block {k} gradient")
        assert_matches(block["loss"], loss, dtype, what=f"block {k} loss")
        assert losses[k // 3, k % 3] == block["loss"]
    assert_matches(np.array(body["accumulated"]), reference_accumulated(cast, 3, objective, 1.5), dtype,
                   what="accumulated")


def test_float32_output_is_float32_exact(client):
    response, body = post(client, {"vectors": [[0.1, 0.2], [0.3, 0.4]], "objective": "sum_of_squares",
                                   "factor": 1})
    grad = np.array(body["blocks"][0]["gradient"], dtype=np.float32)
    assert grad[0, 0, 0] == np.float32(2) * np.float32(0.1)
    assert body["blocks"][0]["gradient"][0][0][0] == 0.2  # shortest float32 digits, not 0.20000000298


@pytest.mark.parametrize("outputs,keys", [
    (["accumulated"], {"accumulated"}), (["losses"], {"losses"}), (["blocks"], {"blocks"}),
    (["blocks", "losses", "blocks"], {"blocks", "losses"}),
])
def test_only_requested_outputs_appear(client, outputs, keys):
    response, body = post(client, dict(GOOD, outputs=outputs))
    assert response.status_code == 200
    always = {"n", "dim", "factor", "bounds", "objective", "dtype", "device"}
    assert set(body) == always | keys


def test_default_factor_and_n_equal_one(client):
    response, body = post(client, {"vectors": [[2.0, -1.0, 0.5]], "objective": "sum_of_squares"})
    assert response.status_code == 200
    assert body["factor"] == 1 and body["bounds"] == [0, 1]
    assert body["blocks"][0]["gradient"] == [[[4.0, -2.0, 1.0, 4.0, -2.0, 1.0]]]
    assert body["accumulated"] == [[8.0, -4.0, 2.0]]


def test_integers_are_numbers(client):
    response, body = post(client, {"vectors": [[1, 2], [3, 4]], "factor": 1, "outputs": ["accumulated"]})
    assert response.status_code == 200 and body["accumulated"] == [[4.0, 4.0], [4.0, 4.0]]


# Each bad input, its status and its stable error code.
BAD_JSON = [
    (b"{", "application/json", 400, "bad_json"),
    (b"", "application/json", 400, "bad_json"),
    (b'{"vectors": [[NaN, 1.0]]}', "application/json", 400, "bad_json"),
    (b'{"vectors": [[Infinity]]}', "application/json", 400, "bad_json"),
    (b'{"vectors": [[-Infinity]]}', "application/json", 400, "bad_json"),
    (b'{"vectors": [[1e400]]}', "application/json", 422, "validation_error"),
    (b'{"vectors": [[1.0]]}', "text/plain", 415, "unsupported_media_type"),
    (b'{"vectors": [[1.0]', None, 400, "bad_json"),  # no Content-Type: read as JSON
    (b"vectors=1", "application/x-www-form-urlencoded", 415, "unsupported_media_type"),
    (b"null", "application/json", 422, "validation_error"),
    (b"[[1.0]]", "application/json", 422, "validation_error"),
]

BAD_FIELDS = [
    ({}, "vectors"),
    ({"vectors": [[1.0]], "extra": 1}, "extra"),
    ({"vectors": []}, "vectors"),
    ({"vectors": [[]]}, "vectors"),
    ({"vectors": [[1.0, 2.0], [3.0]]}, "vectors"),
    ({"vectors": [1.0, 2.0]}, "vectors"),
    ({"vectors": "1,2"}, "vectors"),
    ({"vectors": {"a": [1.0]}}, "vectors"),
    ({"vectors": [[1.0, "2"]]}, "vectors"),
    ({"vectors": [[1.0, True]]}, "vectors"),
    ({"vectors": [[False]]}, "vectors"),
    ({"vectors": [[1.0, None]]}, "vectors"),
    ({"vectors": [[1.0, [2.0]]]}, "vectors"),
    ({"vectors": [[1e39, 1.0]]}, "vectors"),
    ({"vectors": [[-1e39]], "dtype": "float32"}, "vectors"),
    ({"vectors": [[10 ** 400]]}, "vectors"),
    ({"vectors": [[1.0]], "factor": 0}, "factor"),
    ({"vectors": [[1.0]], "factor": 2}, "factor"),
    ({"vectors": [[1.0]], "factor": -1}, "factor"),
    ({"vectors": [[1.0]], "factor": 1.0}, "factor"),
    ({"vectors": [[1.0]], "factor": 1.5}, "factor"),
    ({"vectors": [[1.0]], "factor": "1"}, "factor"),
    ({"vectors": [[1.0]], "factor": True}, "factor"),
    ({"vectors": [[1.0]], "factor": None}, "factor"),
    ({"vectors": [[1.0]], "objective": "max"}, "objective"),
    ({"vectors": [[1.0]], "objective": "__import__('os')"}, "objective"),
    ({"vectors": [[1.0]], "outputs": []}, "outputs"),
    ({"vectors": [[1.0]], "outputs": ["gradients"]}, "outputs"),
    ({"vectors": [[1.0]], "outputs": "blocks"}, "outputs"),
    ({"vectors": [[1.0]], "dtype": "float16"}, "dtype"),
    ({"vectors": [[1.0]], "offset": "5"}, "offset"),
    ({"vectors": [[1.0]], "offset": True}, "offset"),
    ({"vectors": [[1.0]], "offset": 1e39}, "offset"),
]


def assert_error(response, status, code):
    assert response.status_code == status, response.get_data()
    assert response.mimetype == "application/json"
    body = strict_json(response.get_data())
    assert set(body) == {"error"}
    assert body["error"]["code"] == code
    assert isinstance(body["error"]["message"], str) and len(body["error"]["message"]) > 10
    return body["error"]


def assert_still_serving(client):
    response, body = post(client, GOOD)
    assert response.status_code == 200 and body["n"] == 3


@pytest.mark.parametrize("data,content_type,status,code", BAD_JSON)
def test_bad_bodies(client, data, content_type, status, code):
    headers = {"Content-Type": content_type} if content_type else {}
    assert_error(client.post("/v1/gradients", data=data, headers=headers), status, code)
    assert_still_serving(client)


@pytest.mark.parametrize("body,field", BAD_FIELDS)
def test_bad_fields(client, body, field):
    error = assert_error(client.post("/v1/gradients", json=body), 422, "validation_error")
    assert field in error["details"]["fields"]
    assert_still_serving(client)


def test_error_names_the_cell(client):
    error = assert_error(client.post("/v1/gradients", json={"vectors": [[1.0, 2.0], [3.0, "x"]]}),
                         422, "validation_error")
    assert "Row 1, column 1" in error["details"]["fields"]["vectors"][0]


def test_non_finite_result_names_the_block(client):
    response = client.post("/v1/gradients", json={"vectors": [[0.0], [0.0], [3e19]], "factor": 3,
                                                  "objective": "sum_of_squares"})
    error = assert_error(response, 422, "non_finite_result")
    assert error["details"] == {"block": {"row": 0, "col": 2}}
    assert_still_serving(client)


@pytest.mark.parametrize("config,body,limit", [
    ({"BLOCKGRAD_MAX_N": 4}, {"vectors": [[1.0]] * 5}, "BLOCKGRAD_MAX_N"),
    ({"BLOCKGRAD_MAX_D": 2}, {"vectors": [[1.0, 2.0, 3.0]]}, "BLOCKGRAD_MAX_D"),
    ({"BLOCKGRAD_MAX_BLOCK_ELEMENTS": 100}, {"vectors": [[1.0]] * 12, "factor": 1},
     "BLOCKGRAD_MAX_BLOCK_ELEMENTS"),
    ({"BLOCKGRAD_MAX_OUTPUT_ELEMENTS": 100}, {"vectors": [[1.0]] * 12, "factor": 4},
     "BLOCKGRAD_MAX_OUTPUT_ELEMENTS"),
])
def test_limits(config, body, limit):
    client = create_app(config).test_client()
    error = assert_error(client.post("/v1/gradients", json=body), 413, "limit_exceeded")
    assert limit in error["message"] and error["details"]["limit"] == limit
    assert_still_serving(client)


def test_block_limit_suggests_a_factor():
    client = create_app({"BLOCKGRAD_MAX_BLOCK_ELEMENTS": 100}).test_client()
    error = assert_error(client.post("/v1/gradients", json={"vectors": [[1.0]] * 12, "factor": 1}),
                         413, "limit_exceeded")
    assert "factor 2 fits" in error["message"]  # 12 -> side 6: 6*6*2 = 72 <= 100
    response, _ = post(client, {"vectors": [[1.0]] * 12, "factor": 2})
    assert response.status_code == 200


def test_block_limit_advice_names_a_factor_that_fits():
    # N=200, D=64, blocks of at most 4 x 4 pairs of 128 numbers: factor 101 leaves a last block of
    # 100 rows; 50 (blocks of side 4) is the factor with the fewest blocks that fits (below it a
    # side is 5 or more), so the cost model's fastest (issue 10), not the nearest that fits (100)
    # nor the next larger (197).
    client = create_app({"BLOCKGRAD_MAX_BLOCK_ELEMENTS": 4 * 4 * 128}).test_client()
    error = assert_error(client.post("/v1/gradients", json={"vectors": [[0.5] * 64] * 200, "factor": 101,
                                                            "outputs": ["losses"]}), 413, "limit_exceeded")
    suggested = error["details"]["suggested_factor"]
    assert f"factor {suggested} fits" in error["message"]
    response, _ = post(client, {"vectors": [[0.5] * 64] * 200, "factor": suggested, "outputs": ["losses"]})
    assert suggested == 50 and response.status_code == 200


def test_output_limit_allows_fewer_outputs():
    client = create_app({"BLOCKGRAD_MAX_OUTPUT_ELEMENTS": 100}).test_client()
    assert_error(client.post("/v1/gradients", json={"vectors": [[1.0]] * 12}), 413, "limit_exceeded")
    response, _ = post(client, {"vectors": [[1.0]] * 12, "outputs": ["accumulated", "losses"]})
    assert response.status_code == 200


def test_body_too_large():
    client = create_app({"BLOCKGRAD_MAX_BODY_BYTES": 1000}).test_client()
    assert_error(client.post("/v1/gradients", json={"vectors": [[1.0] * 100] * 10}), 413, "too_large")
    assert_still_serving(client)


def test_unknown_route_and_method_are_json(client):
    assert_error(client.get("/nowhere"), 404, "not_found")
    response = client.get("/v1/gradients")
    assert_error(response, 405, "method_not_allowed")
    assert "POST" in response.headers["Allow"]
    assert_error(client.delete("/healthz"), 405, "method_not_allowed")


def test_internal_error_hides_internals(client, monkeypatch, caplog):
    def explode(*args, **kwargs):
        raise RuntimeError("secret internal detail")
    monkeypatch.setattr("app.http.pipeline.run", explode)
    error = assert_error(client.post("/v1/gradients", json=GOOD), 500, "internal_error")
    assert "secret" not in json.dumps(error)
    assert "secret internal detail" in caplog.text
    monkeypatch.undo()
    assert_still_serving(client)


def test_health_and_ready(client):
    response = client.get("/healthz")
    assert response.status_code == 200 and strict_json(response.get_data())["status"] == "ok"
    response = client.get("/readyz")
    assert response.status_code == 200
    assert strict_json(response.get_data()) == {"status": "ready", "device": "cpu",  # no runner: no worker
                                                "cluster": {"store": "sqlite", "reachable": False, "workers": 0}}


def test_not_ready_with_unusable_device():
    client = create_app({"BLOCKGRAD_DEVICE": "tpu"}).test_client()
    assert_error(client.get("/readyz"), 503, "not_ready")


def test_a_small_answer_goes_out_whole_and_the_same_as_streamed(client, monkeypatch):
    """Blocks kept from pass one and about one chunk of JSON: one body with a Content-Length
    (one write); the same bytes the streamed form sends, which larger answers still use."""
    vectors = np.arange(30, dtype=np.float64).reshape(10, 3).tolist()
    whole = client.post("/v1/gradients", json={"vectors": vectors, "outputs": ["blocks", "accumulated", "losses"]},
                        buffered=False)
    assert whole.status_code == 200
    assert int(whole.headers["Content-Length"]) == len(whole.get_data())
    monkeypatch.setattr("app.api.v1.gradients.WHOLE_ANSWER_NUMBERS", 0)
    streamed = client.post("/v1/gradients", json={"vectors": vectors, "outputs": ["blocks", "accumulated", "losses"]},
                           buffered=False)
    assert "Content-Length" not in streamed.headers
    assert whole.get_data() == streamed.get_data()
    monkeypatch.undo()
    large = client.post("/v1/gradients", json={"vectors": np.ones((64, 3)).tolist(), "factor": 2}, buffered=False)
    assert "Content-Length" not in large.headers  # 64 * 64 * 6 block numbers: over WHOLE_ANSWER_NUMBERS
    assert len(strict_json(large.get_data())["blocks"]) == 4


@pytest.mark.parametrize("sizes,field", [
    ((1, 0, 1, ("accumulated",)), "vectors"),  # {"vectors": [[]]}: 500 under gunicorn before (issue 27)
    ((0, 2, None, None), "vectors"),
])
def test_sizes_are_refused_before_any_model_reads_them(sizes, field):
    """A Sizes is what admission, the cost and the memory models read; one with N or D of 0
    (they divide by D) cannot be made. The contract on the real server: tests/test_contract.py."""
    from app.core.errors import BlockgradError
    from app.core.request import Sizes

    with pytest.raises(BlockgradError) as refused:
        Sizes(*sizes)
    assert refused.value.code == "validation_error" and list(refused.value.details["fields"]) == [field]
