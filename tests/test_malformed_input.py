"""No 500 and no reflected Host for malformed input; error bodies bounded in size and cost
(issue 11). In-process here; the chunked-body cases against real gunicorn are in
test_malformed_chunked.py."""
import sys

import orjson
import pytest

from .test_api import assert_error, assert_still_serving, strict_json

MAX_ERROR_BODY_BYTES = 16384  # docs/api.md: every error body is at most 16 KiB (not the code's own constant)

JSON = {"Content-Type": "application/json"}
INFER = "/v2/models/blockgrad/infer"
SMALL_INPUT = {"name": "vectors", "shape": [1, 1], "datatype": "FP32", "data": [1.0]}


# --- deep nesting on every parser path


@pytest.mark.parametrize("depth", [2000, 100_000])
def test_deep_nesting_after_an_overflowing_number_is_bad_json(client, depth):
    # 1e400 sends the body to the stdlib fallback parser, which recurses per level.
    body = b'{"vectors":[[1e400,2]],"x":' + b"[" * depth + b"]" * depth + b"}"
    error = assert_error(client.post("/v1/gradients", data=body, headers=JSON), 400, "bad_json")
    assert "deep" in error["message"]
    assert_still_serving(client)


def test_deep_nesting_without_an_overflowing_number_is_bad_json(client):
    body = b'{"vectors":[[1,2]],"x":' + b"[" * 2000 + b"]" * 2000 + b"}"
    assert_error(client.post("/v1/gradients", data=body, headers=JSON), 400, "bad_json")


@pytest.mark.parametrize("prefix", [b'{"inputs":[{"name":"vectors","shape":[1,1],"datatype":"FP64","data":[1e400]}],'
                                    b'"x":', b'{"inputs":'])
def test_v2_deep_nesting_is_400(client, prefix):
    body = prefix + b"[" * 5000 + b"]" * 5000 + b"}"
    response = client.post(INFER, data=body, headers=JSON)
    assert response.status_code == 400 and "error" in strict_json(response.get_data())


# --- oversized numeric headers


@pytest.mark.parametrize("length", ["9" * 4301, "1" + "0" * 5000])
def test_huge_inference_header_content_length_is_400(client, length):
    document = orjson.dumps({"inputs": [SMALL_INPUT]})
    response = client.post(INFER, data=document, headers={**JSON, "Inference-Header-Content-Length": length})
    assert response.status_code == 400
    assert "Inference-Header-Content-Length" in strict_json(response.get_data())["error"]


def test_leading_zeros_in_inference_header_content_length_still_count(client):
    document = orjson.dumps({"inputs": [SMALL_INPUT]})
    length = "0" * 5000 + str(len(document))
    response = client.post(INFER, data=document, headers={**JSON, "Inference-Header-Content-Length": length})
    assert response.status_code == 200


# --- no reflected Host


@pytest.mark.parametrize("path", ["/v2//health/live", "/v2/models//blockgrad", "/docs/assets//x",
                                  "//v2/health/live", "/v1//gradients", "/v2/health/live/"])
def test_double_slashes_are_404_json_without_location(client, path):
    response = client.get(path, headers={"Host": "evil.com"})
    assert response.status_code == 404
    assert response.mimetype == "application/json"
    assert "Location" not in response.headers
    assert b"evil.com" not in response.get_data()


def test_no_redirect_to_the_host_header(app, client):
    # A rule ending in "/" redirects its slash-less path (strict_slashes) to an absolute URL
    # built from Host, unless the slash-less path is a rule of its own.
    rules = {rule.rule for rule in app.url_map.iter_rules()}
    for rule in sorted(rules):
        if rule.endswith("/") and "<" not in rule:
            assert rule.rstrip("/") in rules, f"{rule} would redirect {rule.rstrip('/')} to the Host"
            response = client.get(rule.rstrip("/"), headers={"Host": "evil.com"})
            assert "evil.com" not in response.headers.get("Location", "")


# --- error bodies bounded in size and cost


def many_keys(count: int, base: dict) -> bytes:
    document = dict(base)
    document.update((f"k{i}", 1) for i in range(count))
    return orjson.dumps(document)


def test_many_unknown_keys_are_cut_with_a_count(client):
    response = client.post("/v1/gradients", data=many_keys(100_000, {"vectors": [[1.0]]}), headers=JSON)
    error = assert_error(response, 422, "validation_error")
    assert len(response.get_data()) <= MAX_ERROR_BODY_BYTES
    assert error["details"]["unknown_fields"] == 100_000
    assert len(error["details"]["fields"]) == 16 and "and 99984 more" in error["message"]
    assert all(messages == ["Unknown field."] for messages in error["details"]["fields"].values())


def test_a_few_unknown_keys_are_still_listed_beside_other_errors(client):
    response = client.post("/v1/gradients", json={"vectors": [[1.0]], "factor": 0, "extra": 1})
    fields = assert_error(response, 422, "validation_error")["details"]["fields"]
    assert set(fields) == {"factor", "extra"}


def python_calls(fn) -> int:
    """How many Python functions `fn()` calls (in this thread): a count, not a duration."""
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        if event == "call":
            count += 1
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


def test_refusing_many_unknown_keys_does_not_visit_each_key_in_python(client):
    """Listing each unknown key (marshmallow's way) is at least one Python call per key; the
    refusal works on the parsed document in C (a set difference) and cuts the list: the
    Python calls it makes do not grow with the number of keys."""
    def refusal(count):
        body = many_keys(count, {"vectors": [[1.0]]})  # built before counting

        def refuse():
            response = client.post("/v1/gradients", data=body, headers=JSON)
            assert_error(response, 422, "validation_error")
        return refuse
    refusal(10)()  # lazy set-up, not counted
    few, many = python_calls(refusal(1_000)), python_calls(refusal(400_000))
    assert many < 2 * few + 1_000, (few, many)
    assert many < 400_000 // 100  # orders of magnitude below one call per key


@pytest.mark.parametrize("key_chars", [1_000_000, 8 * 1024 * 1024])
def test_a_huge_key_is_not_echoed(client, key_chars):
    body = orjson.dumps({"vectors": [[1.0]], "k" * key_chars: 1})
    response = client.post("/v1/gradients", data=body, headers=JSON)
    error = assert_error(response, 422, "validation_error")
    assert len(response.get_data()) <= MAX_ERROR_BODY_BYTES
    assert f"{key_chars - 64} more characters" in error["message"] and "k" * 65 not in error["message"]


@pytest.mark.parametrize("document", [
    lambda: {"inputs": [SMALL_INPUT], **{f"k{i}": 1 for i in range(50_000)}},
    lambda: {"inputs": [SMALL_INPUT], "parameters": {f"p{i}": 1 for i in range(50_000)}},
    lambda: {"inputs": [{**SMALL_INPUT, "parameters": {f"p{i}": 1 for i in range(50_000)}}]},
    lambda: {"inputs": [{**SMALL_INPUT, **{f"k{i}": 1 for i in range(50_000)}}]},
    lambda: {"inputs": [SMALL_INPUT] * 50_000},
    lambda: {"inputs": [SMALL_INPUT], "outputs": [{"name": "bounds"}] * 50_000},
    lambda: {"inputs": [SMALL_INPUT], "outputs": [{"name": "bounds", "parameters": {f"p{i}": 1 for i in range(50_000)}}]},
    lambda: {"inputs": [SMALL_INPUT], "k" * 4_000_000: 1},
])
def test_v2_long_envelopes_are_400_and_short(client, document):
    response = client.post(INFER, data=orjson.dumps(document()), headers=JSON)
    assert response.status_code == 400
    assert len(response.get_data()) <= MAX_ERROR_BODY_BYTES
    assert response.headers["X-Blockgrad-Error-Code"] == "validation_error"


def test_bounded_error_keeps_code_status_and_headers():
    from app.core.errors import validation_error
    from app.http.errors import bounded_error

    error = validation_error({f"f{i}": ["x" * 10_000] * 100 for i in range(1000)})
    short = bounded_error(error)
    assert short.code == error.code and len(error.details["fields"]) == 1000  # the original is untouched
    assert len(short.details["fields"]) == 25 and short.details["fields"]["_truncated"] == 976
    assert len(orjson.dumps(short.details)) < 400_000  # of the original's 1 GB


def test_every_error_body_fits_even_with_many_long_details(monkeypatch):
    from app import create_app
    from app.core.errors import validation_error

    client = create_app().test_client()

    def refuse(*args, **kwargs):
        raise validation_error({f"f{i}" * 100: ["y" * 5000] * 16 for i in range(16)})
    monkeypatch.setattr("app.http.pipeline.run", refuse)
    response = client.post("/v1/gradients", json={"vectors": [[1.0]]})
    assert_error(response, 422, "validation_error")
    assert len(response.get_data()) <= MAX_ERROR_BODY_BYTES


@pytest.mark.parametrize("document", [b"[1, 2]", b"3", b'"vectors"'])
def test_a_body_that_is_not_an_object_is_a_422_saying_so(client, document):
    error = assert_error(client.post("/v1/gradients", data=document, headers=JSON), 422, "validation_error")
    assert "JSON object" in error["message"] and list(error["details"]["fields"]) == ["_schema"]
