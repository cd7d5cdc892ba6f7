"""Reading and decoding the request body: encodings, chunked bodies over the limit,
lone surrogates, error bodies that cannot be serialised, and admission before the
numbers are converted (review findings; issue 2 and issue 3 contracts)."""
import gzip
import http.client
import io
import os

import numpy as np
import orjson
import pytest
from flask import abort
from werkzeug import Request
from werkzeug.test import EnvironBuilder

import app.core.vectors as vectors
from app import create_app
from app.core.errors import validation_error

from tools.server import gunicorn_server
from .test_api import GOOD, assert_error, assert_still_serving, post, strict_json

JSON = {"Content-Type": "application/json"}


# --- 1. lone surrogates beside a number beyond float64, and error bodies that cannot be written


def test_lone_surrogate_beside_overflowing_number_is_bad_json(client):
    # 1e400 sends the body to the stdlib fallback, which alone accepts "\ud800".
    response = client.post("/v1/gradients", data=rb'{"vectors":[[1e400]],"x\ud800":1}', headers=JSON)
    error = assert_error(response, 400, "bad_json")
    assert "surrogate" in error["message"]
    assert_still_serving(client)


def test_lone_surrogate_in_a_value_is_bad_json(client):
    response = client.post("/v1/gradients", data=rb'{"vectors":[[1e400]],"objective":"\udc00"}', headers=JSON)
    assert_error(response, 400, "bad_json")


def test_surrogate_pair_beside_overflowing_number_still_names_the_cell(client):
    # A valid pair (U+1F600) is fine JSON: the answer stays the 422 that names the cell.
    response = client.post("/v1/gradients", data=rb'{"vectors":[[1e400]],"x\ud83d\ude00":1}', headers=JSON)
    error = assert_error(response, 422, "validation_error")
    assert error["details"]["fields"]["vectors"] == ["Row 0, column 0 is not a finite number."]
    assert "x\U0001F600" in error["details"]["fields"]


def test_error_body_that_cannot_be_serialised_keeps_status_and_code(monkeypatch, caplog):
    client = create_app().test_client()  # not TESTING: exceptions are handled, not propagated

    def refuse(*args, **kwargs):
        raise validation_error({"x\ud800": ["Unknown field."]}, "bad field x\ud800")
    monkeypatch.setattr("app.http.pipeline.run", refuse)
    error = assert_error(client.post("/v1/gradients", json=GOOD), 422, "validation_error")
    assert "could not be written as JSON" in error["message"]
    assert "could not be serialised" in caplog.text
    monkeypatch.undo()
    assert_still_serving(client)


def test_werkzeug_internal_server_error_is_internal_error():
    app = create_app()

    class Broken(Exception):
        pass

    @app.errorhandler(Broken)
    def broken_handler(exc):
        raise RuntimeError("the error handler itself failed")  # Flask turns this into InternalServerError

    @app.route("/handler-fails")
    def handler_fails():
        raise Broken()

    @app.route("/aborts")
    def aborts():
        abort(500)

    client = app.test_client()
    for path in ("/handler-fails", "/aborts"):
        error = assert_error(client.get(path), 500, "internal_error")
        assert error["message"] == "The server failed on this request; it has been logged."
        assert "failed on" in error["message"] and "handler itself" not in error["message"]


# --- 2. chunked bodies (no Content-Length) over BLOCKGRAD_MAX_BODY_BYTES

LIMIT = 200


def chunked_request(body: bytes) -> dict:
    """What a WSGI server that decodes chunked bodies (gunicorn) hands the app: no
    Content-Length, the body as the input stream, and wsgi.input_terminated set."""
    return dict(path="/v1/gradients", method="POST", input_stream=io.BytesIO(body), content_type="application/json",
                headers={"Transfer-Encoding": "chunked"}, environ_overrides={"wsgi.input_terminated": True})


def post_chunked(client, body: bytes):
    return client.open(**chunked_request(body))


def padded(document: bytes, length: int, pad: bytes = b" ") -> bytes:
    assert len(document) <= length
    return document + pad * (length - len(document))


def test_chunked_environ_reaches_werkzeugs_silent_truncation():
    """The tests below exercise the no-Content-Length path: werkzeug alone would hand
    the app a body cut at the limit, without an error."""
    request = Request(EnvironBuilder(**chunked_request(b"x" * (LIMIT + 50))).get_environ())
    assert "CONTENT_LENGTH" in request.environ  # the test client sets one, but chunked overrides it
    request.max_content_length = LIMIT
    assert request.content_length is None
    assert len(request.get_data(cache=False)) == LIMIT


@pytest.mark.parametrize("body", [
    padded(b'{"vectors": [[1.0]]}', LIMIT + 1),  # whitespace after a valid document: was a 200
    padded(b'{"vectors": [[1.0]]}', 3 * LIMIT),
    b'{"vectors": [[' + b"1.0, " * LIMIT + b"1.0]]}",  # cut mid-document: was a 400 bad_json
])
def test_chunked_body_over_limit_is_too_large(body):
    client = create_app({"BLOCKGRAD_MAX_BODY_BYTES": LIMIT}).test_client()
    error = assert_error(post_chunked(client, body), 413, "too_large")
    assert "BLOCKGRAD_MAX_BODY_BYTES" in error["message"]


def test_chunked_body_at_the_limit_is_served():
    client = create_app({"BLOCKGRAD_MAX_BODY_BYTES": LIMIT}).test_client()
    response = post_chunked(client, padded(b'{"vectors": [[1.0], [2.0]], "factor": 1}', LIMIT))
    assert response.status_code == 200
    assert strict_json(response.get_data())["accumulated"] == [[4.0], [4.0]]  # sum: 2N, as the seed's 20 for N=10
    assert post_chunked(client, padded(b'{"vectors": [[1.0]]}', LIMIT - 1)).status_code == 200


def chunked_post(port: int, chunks: list[bytes]) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request("POST", "/v1/gradients", body=iter(chunks), headers=JSON, encode_chunked=True)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


@pytest.mark.slow
def test_gunicorn_chunked_body_over_limit_is_too_large():
    limit = 1024
    at_limit = padded(b'{"vectors": [[1.0], [2.0]], "factor": 1}', limit)
    with gunicorn_server(workers=1, env={"BLOCKGRAD_MAX_BODY_BYTES": str(limit)}) as server:
        status, body = chunked_post(server.port, [at_limit[:500], at_limit[500:]])
        assert status == 200 and strict_json(body)["n"] == 2
        over = padded(b'{"vectors": [[1.0]]}', 2 * limit)
        status, body = chunked_post(server.port, [over[:700], over[700:1400], over[1400:]])
        assert status == 413 and strict_json(body)["error"]["code"] == "too_large"
        status, body = chunked_post(server.port, [at_limit])  # the worker serves on
        assert status == 200


# --- 3. compressed bodies


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "GZIP"])
def test_compressed_body_is_unsupported_media_type(client, encoding):
    response = client.post("/v1/gradients", data=gzip.compress(orjson.dumps(GOOD)),
                           headers={**JSON, "Content-Encoding": encoding})
    error = assert_error(response, 415, "unsupported_media_type")
    assert "uncompressed" in error["message"]
    assert_still_serving(client)


def test_identity_encoding_is_served(client):
    response, body = post(client, GOOD, headers={"Content-Encoding": "identity"})
    assert response.status_code == 200 and body["n"] == 3


# --- 4. admission before conversion, and the body limit's default


@pytest.fixture
def no_conversion(monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError("a refused request had its numbers converted")
    monkeypatch.setattr(vectors, "parse_matrix", must_not_run)


@pytest.mark.parametrize("config,body,limit", [
    ({"BLOCKGRAD_MAX_N": 4}, {"vectors": [[1.0]] * 5}, "BLOCKGRAD_MAX_N"),
    ({"BLOCKGRAD_MAX_D": 2}, {"vectors": [[1.0, 2.0, 3.0]]}, "BLOCKGRAD_MAX_D"),
    # factor or outputs the schema will refuse: N and D are still decided first
    ({"BLOCKGRAD_MAX_N": 4}, {"vectors": [[1.0]] * 5, "factor": "2", "outputs": "all"}, "BLOCKGRAD_MAX_N"),
    ({"BLOCKGRAD_MAX_BLOCK_ELEMENTS": 100}, {"vectors": [[1.0]] * 12, "factor": 1},
     "BLOCKGRAD_MAX_BLOCK_ELEMENTS"),
    ({"BLOCKGRAD_MAX_OUTPUT_ELEMENTS": 100}, {"vectors": [[1.0]] * 12}, "BLOCKGRAD_MAX_OUTPUT_ELEMENTS"),
    ({"BLOCKGRAD_MAX_OUTPUT_ELEMENTS": 100}, {"vectors": [[1.0]] * 12, "factor": 4,
                                              "outputs": ["blocks", "blocks"]}, "BLOCKGRAD_MAX_OUTPUT_ELEMENTS"),
])
def test_limits_are_decided_before_conversion(no_conversion, config, body, limit):
    client = create_app(config).test_client()
    error = assert_error(client.post("/v1/gradients", json=body), 413, "limit_exceeded")
    assert error["details"]["limit"] == limit


def test_refused_before_conversion_however_large(no_conversion):
    # The reviewer's body (N=8192, D=1950 of 1.5) at a tenth of the rows: refused on its sizes.
    client = create_app().test_client()
    body = orjson.dumps({"vectors": [[1.5] * 1950] * 820})
    error = assert_error(client.post("/v1/gradients", data=body, headers=JSON), 413, "limit_exceeded")
    assert error["details"]["limit"] in ("BLOCKGRAD_MAX_BLOCK_ELEMENTS", "BLOCKGRAD_MAX_OUTPUT_ELEMENTS")


def test_invalid_factor_is_the_schemas_to_refuse():
    # The output limit needs a valid factor: with "4" the schema answers first (422).
    client = create_app({"BLOCKGRAD_MAX_OUTPUT_ELEMENTS": 100}).test_client()
    error = assert_error(client.post("/v1/gradients", json={"vectors": [[1.0]] * 12, "factor": "4"}),
                         422, "validation_error")
    assert "factor" in error["details"]["fields"]


@pytest.mark.skipif("BLOCKGRAD_MAX_BODY_BYTES" in os.environ, reason="the default is overridden here")
def test_default_body_limit_is_32_mib():
    assert create_app().config["MAX_CONTENT_LENGTH"] == 33554432
    assert create_app().config["MAX_CONTENT_LENGTH"] == 33554432


@pytest.mark.skipif("BLOCKGRAD_MAX_BODY_BYTES" in os.environ, reason="the default is overridden here")
def test_full_precision_4096_by_64_body_fits_the_default_limit(client):
    vectors = np.random.default_rng(0).standard_normal((4096, 64))
    # factor N and only losses: admitted; the unknown dtype makes the schema answer without computing.
    body = orjson.dumps({"vectors": vectors.tolist(), "factor": 4096, "outputs": ["losses"], "dtype": "float16"})
    assert 5_000_000 < len(body) < 33554432
    error = assert_error(client.post("/v1/gradients", data=body, headers=JSON), 422, "validation_error")
    assert list(error["details"]["fields"]) == ["dtype"]


# --- 5. advice that fits the dtype


def test_non_finite_advice_suggests_float64_only_to_float32(client):
    body = {"vectors": [[0.0], [0.0], [3e19]], "factor": 3, "objective": "sum_of_squares"}
    error = assert_error(client.post("/v1/gradients", json=body), 422, "non_finite_result")
    assert "or dtype float64" in error["message"]
    body = {"vectors": [[0.0], [0.0], [1e200]], "factor": 3, "objective": "sum_of_squares", "dtype": "float64"}
    error = assert_error(client.post("/v1/gradients", json=body), 422, "non_finite_result")
    assert error["details"] == {"block": {"row": 0, "col": 2}}
    assert "float64" not in error["message"].split(";", 1)[1]
    assert "send smaller values or another objective" in error["message"]


def test_overflow_advice_suggests_float64_to_float32(client):
    error = assert_error(client.post("/v1/gradients", json={"vectors": [[1e39]]}), 422, "validation_error")
    assert error["details"]["fields"]["vectors"] == [
        "Row 0, column 0 overflows float32; send smaller values or use dtype float64."]


def test_accumulated_advice_fits_the_dtype():
    from app.core.errors import non_finite_advice
    assert "float64" in non_finite_advice("float32")
    assert "float64" not in non_finite_advice("float64")
