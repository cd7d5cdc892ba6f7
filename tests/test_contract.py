"""The contract, on the server users run (issue 27): every code of the error table produced by
its real condition, the bad inputs of docs/api.md and docs/errors-edge.md, and the README's
worked examples, against `served` (tests/conftest.py: gunicorn as `make serve` starts it, with
its embedded Dask cluster) on /v1, /v2 and /v1/jobs alike.

Expected answers are literals from the docs (docs/api.md, README.md) or tools/reference.py,
never the code under test. Codes that need a setting the defaults do not have (a token, a
short deadline, a one-place queue, an unusable device, an unreachable scheduler, short read
timeouts) come from three more servers below (`edge`, `short_deadline`, `impatient`), so that a
short setting only ever decides the test that waits for it to run out. Not produced here: `internal_error` and
`device_out_of_memory` are injected faults (a bug, a GPU out of memory), tested by patching in
tests/test_error_table.py.
"""
import io
import json
import re
import socket
import uuid

import numpy as np
import pytest
import requests
import torch

from app.http.errors import ERRORS
from tools.reference import reference_accumulated, reference_blocks
from tools.server import gunicorn_server, wait_until

from .events import HeldSlots
from .test_readme import curl_examples

pytestmark = pytest.mark.slow

WAIT_S = 120  # bounded waits: a busy 2-core machine, a cluster that starts beside the server
GOOD = {"vectors": [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], "outputs": ["accumulated"]}
V1, V2, JOBS = "/v1/gradients", "/v2/models/blockgrad/infer", "/v1/jobs"
CODE_HEADER = "X-Blockgrad-Error-Code"


# --- helpers -------------------------------------------------------------------------------
def post(server, path, body=None, *, data=None, headers=None):
    return requests.post(server.url + path, json=body, data=data, headers=headers, timeout=WAIT_S)


def v1_error(response, status: int, code: str) -> dict:
    """/v1's shape (docs/api.md, "Errors"): {"error": {"code", "message", "details"}}, the code in its header."""
    assert response.status_code == status, response.text
    assert response.headers["Content-Type"] == "application/json"
    assert response.headers[CODE_HEADER] == code
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "details"}, body
    assert body["error"]["code"] == code and body["error"]["message"]
    return body["error"]


def v2_error(response, status: int, code: str) -> str:
    """/v2's shape (the protocol's): {"error": "<message>"}, the code in the header."""
    assert response.status_code == status, response.text
    assert response.headers[CODE_HEADER] == code
    body = response.json()
    assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"], body
    return body["error"]


def still_serving(server, headers=None):
    answer = post(server, V1, GOOD, headers=headers)
    assert answer.status_code == 200, answer.text
    assert answer.json()["accumulated"] == [[6.0, 6.0]] * 3  # sum: 2N per entry


def exchange(port: int, raw: bytes, *, half_close: bool = False) -> bytes:
    """Send `raw` bytes, then read until the server closes (bounded by the socket timeout)."""
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
        sock.sendall(raw)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        received = b""
        while True:
            try:
                piece = sock.recv(65536)
            except ConnectionResetError:
                break
            if not piece:
                break
            received += piece
        return received


def head_and_body(raw: bytes) -> tuple[int, dict, bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def submitted_job(server, body) -> requests.Response:
    """POST /v1/jobs; a cluster still starting answers 503 with Retry-After (docs/jobs.md): retried."""
    answers = []

    def accepted():
        answers.append(post(server, JOBS, body))
        return answers[-1].status_code != 503
    assert wait_until(accepted, WAIT_S, 1.0), answers[-1].text
    return answers[-1]


def finished_job(server, location: str) -> dict:
    records = []

    def finished():
        records.append(requests.get(server.url + location, timeout=WAIT_S))
        return records[-1].status_code == 200 and records[-1].json()["status"] in ("succeeded", "failed", "cancelled")
    assert wait_until(finished, WAIT_S, 0.3), records[-1].text
    return records[-1].json()


# --- the empty-row 500 (issue 27): sizes validated before any cost or memory model ----------
EMPTY_ROWS = {"fields": {"vectors": ["Rows must not be empty."]}}  # docs/api.md: `vectors` non-empty
NO_ROWS = {"fields": {"vectors": ["Must be a non-empty list of rows, each a list of numbers."]}}


@pytest.mark.parametrize("raw,details", [
    (b'{"vectors": [[]]}', EMPTY_ROWS),
    (b'{"vectors": [[], []]}', EMPTY_ROWS),
    (b'{"vectors": [[], [1.0]]}', EMPTY_ROWS),
    (b'{"vectors": [[1.0]], "vectors": [[]]}', EMPTY_ROWS),  # the last key counts (docs/api.md)
    (b'{"vectors": [[]], "outputs": ["accumulated"], "dtype": "float64"}', EMPTY_ROWS),
    (b'{"vectors": []}', NO_ROWS),
])
@pytest.mark.parametrize("path", [V1, JOBS])
def test_empty_rows_are_422_not_500(served, path, raw, details):
    error = v1_error(post(served, path, data=raw, headers={"Content-Type": "application/json"}),
                     422, "validation_error")
    assert error["details"] == details
    still_serving(served)


@pytest.mark.parametrize("shape", [[1, 0], [0, 2], [0, 0], [3, 0]])
def test_v2_empty_shapes_are_400_not_500(served, shape):
    body = {"inputs": [{"name": "vectors", "datatype": "FP32", "shape": shape, "data": []}]}
    message = v2_error(post(served, V2, body), 400, "validation_error")
    assert "must be at least 1" in message
    still_serving(served)


@pytest.mark.parametrize("shape,details", [((1, 0), EMPTY_ROWS), ((0, 2), NO_ROWS)])
def test_an_empty_npy_job_is_422(served, shape, details):
    answer = post(served, JOBS, data=npy(np.zeros(shape)), headers={"Content-Type": "application/x-npy"})
    assert v1_error(answer, 422, "validation_error")["details"] == details


# --- every code of the error table, by its real condition ----------------------------------
# code -> the test below that produces it on a real server; a code added to the table fails
# test_every_code_is_produced until it has one.
PRODUCED = {
    "bad_request": "test_bad_request_malformed_chunks_and_short_bodies",
    "bad_json": "test_bad_json",
    "unauthorized": "test_unauthorized",
    "not_found": "test_not_found",
    "model_not_found": "test_model_not_found",
    "method_not_allowed": "test_method_not_allowed",
    "too_large": "test_too_large",
    "limit_exceeded": "test_limit_exceeded",
    "unsupported_media_type": "test_unsupported_media_type",
    "validation_error": "test_validation_error",
    "non_finite_result": "test_non_finite_result",
    "deadline_exceeded": "test_deadline_exceeded_in_the_queue",
    "not_ready": "test_not_ready",
    "read_timeout": "test_read_timeout",
    "overloaded": "test_queue_full_overloaded_then_client_closed",
    "client_closed": "test_queue_full_overloaded_then_client_closed",
    "job_not_found": "test_job_not_found",
    "job_not_done": "test_job_not_done_and_a_job_exact",
    "cluster_unavailable": "test_cluster_unavailable_on_a_get",
}
INJECTED = {"internal_error", "device_out_of_memory"}  # tests/test_error_table.py, by patching
# The job store's codes, made in process by tests/test_error_table.py (job_attempts_exhausted: a job's error).
INJECTED |= {"store_unavailable", "job_done", "job_attempts_exhausted", "idempotency_key_reused"}


def test_every_code_is_produced():
    assert set(PRODUCED) | INJECTED == set(ERRORS)
    assert all(name in globals() for name in PRODUCED.values())


def test_bad_request_malformed_chunks_and_short_bodies(served):
    # A bad chunk size: gunicorn's parser raises inside the app's body read (docs/api.md, 400 bad_request).
    raw = exchange(served.port, b"POST /v1/gradients HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\nzz\r\n{}\r\n0\r\n\r\n")
    status, headers, body = head_and_body(raw)
    assert (status, headers[CODE_HEADER.lower()]) == (400, "bad_request")
    assert json.loads(body)["error"]["code"] == "bad_request"
    # A body cut short of its Content-Length, then EOF (docs/errors-edge.md): both sizes named.
    for path, v2 in ((V1, False), (V2, True)):
        raw = exchange(served.port, f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                    f"Content-Length: 1000\r\n\r\n".encode() + b" " * 500, half_close=True)
        status, headers, body = head_and_body(raw)
        assert (status, headers[CODE_HEADER.lower()]) == (400, "bad_request"), raw[:300]
        message = "The body ended after 500 of the 1000 bytes its Content-Length declares; send the whole body."
        if v2:
            assert json.loads(body) == {"error": message}
        else:
            assert json.loads(body)["error"] == {"code": "bad_request", "message": message,
                                                 "details": {"received": 500, "declared": 1000}}
    still_serving(served)


@pytest.mark.parametrize("raw", [
    b"x", b"", b"{", b'{"vectors": [[NaN, 1.0]]}', b'{"vectors": [[Infinity]]}', b'{"vectors": [[-Infinity]]}',
    b'{"vectors": [["\\ud800"]]}',  # a lone surrogate (docs/api.md)
    b'{"vectors": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",  # deeper than the parsers allow
    b'{"vectors": [[1e400]], "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
])
def test_bad_json(served, raw):
    for path, headers in ((V1, {"Content-Type": "application/json"}), (V1, {}), (JOBS, {})):
        v1_error(post(served, path, data=raw, headers=headers), 400, "bad_json")
    v2_error(post(served, V2, data=raw, headers={"Content-Type": "application/json"}), 400, "bad_json")
    still_serving(served)


def test_not_found(served):
    error = v1_error(requests.get(served.url + "/v1/gradient", timeout=WAIT_S), 404, "not_found")
    assert "/v1/gradient" in error["message"]
    assert {"POST /v1/gradients", "POST /v1/jobs", "GET /healthz", "GET /readyz", "GET /metrics"} \
        <= set(error["details"]["routes"])
    # Empty path segments: 404 JSON, never a redirect built from the Host header (docs/api.md).
    answer = requests.get(served.url + "/v2//health/live", headers={"Host": "evil.example"}, timeout=WAIT_S,
                          allow_redirects=False)
    assert answer.status_code == 404 and "Location" not in answer.headers
    assert answer.headers[CODE_HEADER] == "not_found"


def test_model_not_found(served):
    v2_error(requests.get(served.url + "/v2/models/other", timeout=WAIT_S), 404, "model_not_found")
    v2_error(requests.get(served.url + "/v2/models/blockgrad/versions/2", timeout=WAIT_S), 404, "model_not_found")
    body = {"inputs": [{"name": "vectors", "datatype": "FP32", "shape": [1, 1], "data": [1.0]}]}
    v2_error(post(served, "/v2/models/other/infer", body), 404, "model_not_found")


def test_method_not_allowed(served):
    answer = requests.post(served.url + "/healthz", timeout=WAIT_S)
    error = v1_error(answer, 405, "method_not_allowed")
    assert error["details"] == {"allowed": ["GET", "HEAD", "OPTIONS"]}
    assert "GET" in answer.headers["Allow"]
    assert "POST" in v1_error(requests.get(served.url + V1, timeout=WAIT_S), 405, "method_not_allowed")["message"]


def test_too_large(served):
    details = {"limit": "BLOCKGRAD_MAX_BODY_BYTES", "allowed": 32 * 1024 * 1024}  # docs/configuration.md's default
    # Declared: refused before a byte of the body is read.
    raw = exchange(served.port, b"POST /v1/gradients HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                b"Content-Length: 33554433\r\nConnection: close\r\n\r\n{")
    status, headers, body = head_and_body(raw)
    assert (status, headers[CODE_HEADER.lower()]) == (413, "too_large")
    assert json.loads(body)["error"]["details"] == details
    # Chunked, no Content-Length: counted as it is read (one byte over).
    over = (b"[" + b"0," * (16 * 1024 * 1024) + b"0]")[:32 * 1024 * 1024 + 1]
    answer = post(served, V1, data=iter([over[i:i + 2 ** 20] for i in range(0, len(over), 2 ** 20)]),
                  headers={"Content-Type": "application/json"})
    assert v1_error(answer, 413, "too_large")["details"] == details
    still_serving(served)


def test_limit_exceeded(served):
    error = v1_error(post(served, V1, {"vectors": [[1.0]] * 8193}), 413, "limit_exceeded")
    assert error["details"] == {"limit": "BLOCKGRAD_MAX_N", "value": 8193, "allowed": 8192}
    error = v1_error(post(served, V1, {"vectors": [[1.0] * 4097]}), 413, "limit_exceeded")
    assert error["details"] == {"limit": "BLOCKGRAD_MAX_D", "value": 4097, "allowed": 4096}
    # /v2: the declared shape is checked before any number is read (docs/api.md).
    declared = {"inputs": [{"name": "vectors", "datatype": "FP32", "shape": [8193, 1], "data": []}]}
    assert "BLOCKGRAD_MAX_N" in v2_error(post(served, V2, declared), 413, "limit_exceeded")
    # The largest block: 1024 x 1024 x 8 numbers at factor 1, over 4194304; the suggested factor fits.
    vectors = np.arange(1024 * 4, dtype=np.float64).reshape(1024, 4) / 1024
    body = {"vectors": vectors.tolist(), "factor": 1, "outputs": ["accumulated"], "dtype": "float64"}
    error = v1_error(post(served, V1, body), 413, "limit_exceeded")
    assert error["details"]["limit"] == "BLOCKGRAD_MAX_BLOCK_ELEMENTS"
    assert (error["details"]["value"], error["details"]["allowed"]) == (1024 * 1024 * 8, 4194304)
    suggested = error["details"]["suggested_factor"]
    answer = post(served, V1, {**body, "factor": suggested})
    assert answer.status_code == 200, answer.text
    assert answer.json()["accumulated"] == [[2048.0] * 4] * 1024  # sum: 2N per entry, exact
    # Jobs: their own N limit, BLOCKGRAD_MAX_JOB_N = 131072 (checked before anything is sent to the cluster).
    error = v1_error(post(served, JOBS, {"vectors": [[0]] * 131073}), 413, "limit_exceeded")
    assert error["details"] == {"limit": "BLOCKGRAD_MAX_JOB_N", "value": 131073, "allowed": 131072}


@pytest.mark.parametrize("path", [V1, V2, JOBS])
def test_unsupported_media_type(served, path):
    check = v2_error if path == V2 else v1_error
    check(post(served, path, data=b"{}", headers={"Content-Type": "text/plain"}), 415, "unsupported_media_type")
    compressed = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    check(post(served, path, data=b"{}", headers=compressed), 415, "unsupported_media_type")


def test_json_suffix_media_types_are_json(served):
    answer = post(served, V1, data=json.dumps(GOOD), headers={"Content-Type": "application/vnd.api+json"})
    assert answer.status_code == 200 and answer.json()["accumulated"] == [[6.0, 6.0]] * 3


# docs/api.md's field rules, one bad value each: the field named, on /v1 and /v1/jobs alike.
BAD_FIELDS = [
    ({}, "vectors"), ({"vectors": [[1.0]], "extra": 1}, "extra"),
    ({"vectors": [[1.0, 2.0], [3.0]]}, "vectors"), ({"vectors": [1.0, 2.0]}, "vectors"),
    ({"vectors": [[1.0, "2"]]}, "vectors"), ({"vectors": [[1.0, True]]}, "vectors"),
    ({"vectors": [[1.0, None]]}, "vectors"), ({"vectors": [[1e39, 1.0]]}, "vectors"),
    ({"vectors": [[1.0]], "factor": 0}, "factor"), ({"vectors": [[1.0]], "factor": 2}, "factor"),
    ({"vectors": [[1.0]], "factor": 1.5}, "factor"), ({"vectors": [[1.0]], "factor": True}, "factor"),
    ({"vectors": [[1.0]], "factor": "1"}, "factor"), ({"vectors": [[1.0]], "objective": "max"}, "objective"),
    ({"vectors": [[1.0]], "outputs": []}, "outputs"), ({"vectors": [[1.0]], "dtype": "float16"}, "dtype"),
    ({"vectors": [[1.0]], "offset": True}, "offset"), ({"vectors": [[1.0]], "offset": 1e39}, "offset"),
]


def test_validation_error(served):
    # docs/api.md's table example: factor over N names the field and N.
    error = v1_error(post(served, V1, {**GOOD, "factor": 4}), 422, "validation_error")
    assert error["details"] == {"fields": {"factor": ["Must be between 1 and N = 3."]}}
    # A number beyond float64 is a 422 naming its cell (docs/api.md).
    error = v1_error(post(served, V1, data=b'{"vectors": [[1.0, 2.0], [3.0, 1e400]]}',
                          headers={"Content-Type": "application/json"}), 422, "validation_error")
    assert "Row 1, column 1" in error["details"]["fields"]["vectors"][0]
    for body, field in BAD_FIELDS:
        for path in (V1, JOBS):
            error = v1_error(post(served, path, body), 422, "validation_error")
            assert field in error["details"]["fields"], (path, body)
    # A job cannot return blocks (docs/jobs.md).
    error = v1_error(post(served, JOBS, {"vectors": [[1.0]], "outputs": ["blocks"]}), 422, "validation_error")
    assert "outputs" in error["details"]["fields"]
    # /v2: what /v1 answers with 422 is a 400 there.
    for parameters in ({"factor": 4}, {"factor": True}, {"objective": "max"}, {"unknown": 1}):
        body = {"inputs": [{"name": "vectors", "datatype": "FP32", "shape": [3, 1], "data": [1, 2, 3]}],
                "parameters": parameters}
        v2_error(post(served, V2, body), 400, "validation_error")
    for tensor in ({"datatype": "INT32", "shape": [1, 1], "data": [1]},
                   {"datatype": "FP32", "shape": [2, 2], "data": [1, 2, 3]},
                   {"datatype": "FP32", "shape": [1, 1], "data": ["x"]}):
        v2_error(post(served, V2, {"inputs": [{"name": "vectors", **tensor}]}), 400, "validation_error")
    still_serving(served)


def test_non_finite_result(served):
    body = {"vectors": [[0.0], [1e20]], "factor": 2, "objective": "sum_of_squares"}  # (1e20)^2 overflows float32
    error = v1_error(post(served, V1, body), 422, "non_finite_result")
    assert error["details"] == {"block": {"row": 0, "col": 1}}  # the first block row-block-major
    assert "float32" in error["message"]
    tensor = {"name": "vectors", "datatype": "FP32", "shape": [2, 1], "data": [0.0, 1e20]}
    v2 = {"inputs": [tensor], "parameters": {"factor": 2, "objective": "sum_of_squares"}}
    v2_error(post(served, V2, v2), 400, "non_finite_result")
    # float64 holds it: a 200 whose numbers are finite.
    answer = post(served, V1, {**body, "dtype": "float64", "outputs": ["losses"]})
    assert answer.status_code == 200 and answer.json()["losses"] == [[0.0, 1e40], [1e40, 2e40]]  # concat pairs: 0, 1e40, 1e40, 2 x 1e40


def test_job_not_found(served):
    answers = []

    def answered():  # the embedded cluster may still be starting: 503 with Retry-After, as documented
        answers.append(requests.get(served.url + "/v1/jobs/nope", timeout=WAIT_S))
        return answers[-1].status_code != 503
    assert wait_until(answered, WAIT_S, 1.0), answers[-1].text
    assert v1_error(answers[-1], 404, "job_not_found")["details"] == {"id": "nope"}


def test_job_not_done_and_a_job_exact(served):
    """A job that failed (non-finite in float32) has no result: 409 job_not_done, status failed,
    no Retry-After (docs/api.md). The queued and running cases need a job held at a known
    point: tests/test_jobs.py's. And a job that succeeds: exact against the closed form."""
    created = submitted_job(served, {"vectors": [[0.0], [1e20]], "factor": 2, "objective": "sum_of_squares"})
    assert created.status_code == 202, created.text
    record = finished_job(served, created.headers["Location"])
    assert record["status"] == "failed"
    assert record["error"]["code"] == "non_finite_result" and record["error"]["details"] == {"block": {"row": 0, "col": 1}}
    answer = requests.get(served.url + created.headers["Location"] + "/result", timeout=WAIT_S)
    assert v1_error(answer, 409, "job_not_done")["details"] == {"status": "failed"}
    assert "Retry-After" not in answer.headers
    vectors = np.random.default_rng(27).standard_normal((30, 3))
    created = submitted_job(served, {"vectors": vectors.tolist(), "factor": 4, "dtype": "float64"})
    assert created.status_code == 202, created.text
    assert finished_job(served, created.headers["Location"])["status"] == "succeeded"
    result = requests.get(served.url + created.headers["Location"] + "/result", timeout=WAIT_S).json()
    assert result["accumulated"] == [[60.0] * 3] * 30  # sum: 2N per entry, exact in float64
    expected = [float(loss) for loss, _ in reference_blocks(torch.tensor(vectors), 4, "sum")]
    got = [loss for row in result["losses"] for loss in row]
    assert len(got) == len(expected) == 16
    assert all(abs(g - e) <= 1e-12 * max(1.0, abs(e)) for g, e in zip(got, expected, strict=True))


# --- gunicorn's own answers to malformed heads (docs/errors-edge.md's table) ---------------
@pytest.mark.parametrize("raw,status", [
    (b"GET /" + b"a" * 5000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(101)) + b"\r\n", 431),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 8200 + b"\r\n\r\n", 431),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\nExpect: something-else\r\n\r\n", 417),
    (b"POST /v1/gradients HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
     400),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Bad: a\x00b\r\n\r\n", 400),
    (b"NOT A REQUEST LINE\r\n\r\n", 400),
])
def test_malformed_heads_get_gunicorns_html(served, raw, status):
    got, headers, _ = head_and_body(exchange(served.port, raw))
    assert got == status
    assert headers["content-type"].startswith("text/html") and headers["connection"] == "close"


def test_expect_100_continue_gets_one_interim_answer(served):
    body = json.dumps(GOOD).encode()
    raw = exchange(served.port, b"POST /v1/gradients HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                b"Expect: 100-continue\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body)
                   + body)
    assert raw.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 ")
    assert raw.count(b"HTTP/1.1 100") == 1


# --- the README's worked examples, as literals --------------------------------------------
def test_readme_v1_example_answers_as_shown(served):
    [(_, path, body, shown)] = [example for example in curl_examples() if example[1] == V1]
    answer = post(served, path, body)
    assert answer.status_code == 200
    got = answer.json()
    head = json.loads(shown.splitlines()[0].rstrip(",") + "}")
    head.pop("device")  # where it ran: cpu here, cuda:0 on a GPU machine
    assert {key: got[key] for key in head} == head
    assert got["accumulated"] == [[20.0] * 5] * 10  # "each vector is in 10 row pairs and 10 column pairs"
    losses = json.loads(re.search(r'"losses":(\[\[.*?\]\])', shown).group(1))
    assert losses == [[1305.0, 1367.5001], [1367.5, 1430.0001]]
    if got["device"] == "cpu":  # the README's machine: float32's shortest digits, as written there
        assert got["losses"] == losses
    else:  # a GPU may sum a block's 250 numbers in another order: within float32's rounding
        assert [x for row in got["losses"] for x in row] == pytest.approx([x for row in losses for x in row], rel=1e-6)
    reference = [float(loss) for loss, _ in reference_blocks(torch.tensor(body["vectors"]), 2, "sum")]
    assert [x for row in losses for x in row] == pytest.approx(reference, rel=1e-6)
    # docs/api.md: the same request with the default outputs (1050 numbers) is sent whole, with a Content-Length.
    whole = post(served, path, {"vectors": body["vectors"]})
    assert whole.status_code == 200 and int(whole.headers["Content-Length"]) == len(whole.content)
    assert "chunked" not in whole.headers.get("Transfer-Encoding", "")


def test_readme_v2_example_answers_as_shown(served):
    [(_, path, body, shown)] = [example for example in curl_examples() if example[1] == V2]
    answer = post(served, path, body)
    assert answer.status_code == 200
    got, expected = answer.json(), json.loads(shown)
    got["parameters"].pop("device"), expected["parameters"].pop("device")
    assert got == expected
    vectors = torch.tensor(body["inputs"][0]["data"], dtype=torch.float64).reshape(4, 2)
    assert reference_accumulated(vectors, 2, "sum").flatten().tolist() == [8.0] * 8


def test_v2_binary_tensors_round_trip(served):
    """docs/api.md's binary data: little-endian row-major bytes after the JSON header."""
    vectors = np.arange(8, dtype="<f4").reshape(4, 2)
    header = json.dumps({"inputs": [{"name": "vectors", "datatype": "FP32", "shape": [4, 2],
                                     "parameters": {"binary_data_size": vectors.nbytes}}],
                         "parameters": {"factor": 2, "binary_data_output": True},
                         "outputs": [{"name": "accumulated"}, {"name": "losses"}]}).encode()
    answer = post(served, V2, data=header + vectors.tobytes(),
                  headers={"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(header))})
    assert answer.status_code == 200, answer.text
    length = int(answer.headers["Inference-Header-Content-Length"])
    head = json.loads(answer.content[:length])
    payload = answer.content[length:]
    sizes = [output["parameters"]["binary_data_size"] for output in head["outputs"]]
    assert sizes == [32, 16] and len(payload) == 48
    assert np.frombuffer(payload[:32], "<f4").tolist() == [8.0] * 8  # the README's answer, as bytes
    assert np.frombuffer(payload[32:], "<f4").tolist() == [104.0, 136.0, 136.0, 168.0]


# --- codes that need other settings: three more servers, one worker each -----------------
# A short setting decides only the test whose verdict is that it ran out: every other verdict
# needs something to happen first (a request to queue, a body to be read), so it runs where
# the settings are long.
TOKEN = "contract-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SHORT_DEADLINE_S = 1


@pytest.fixture(scope="module")
def edge():
    """One worker, so that every request meets the same queue, and what each code needs:
    BLOCKGRAD_API_TOKEN (unauthorized), a queue of 1 (overloaded and client_closed, with the
    compute slots held by the test), BLOCKGRAD_DEVICE=cuda (not_ready on a machine without
    CUDA; no test here computes on it), no jobs (BLOCKGRAD_DASK_SCHEDULER=off, as
    gunicorn_server leaves it: cluster_unavailable). Its deadline is WAIT_S: a request waits in the queue until the test
    ends its wait, never until a clock does."""
    env = {"BLOCKGRAD_API_TOKEN": TOKEN, "BLOCKGRAD_REQUEST_TIMEOUT_S": str(WAIT_S),
           "BLOCKGRAD_QUEUE_DEPTH": "1", "BLOCKGRAD_DASK_SCHEDULER": "off"}
    with gunicorn_server(workers=1, device="cuda", env=env) as server:
        yield server
        assert TOKEN not in server.log()


@pytest.fixture(scope="module")
def short_deadline():
    """One worker with a deadline of SHORT_DEADLINE_S (deadline_exceeded, and limit_exceeded for
    a request predicted past it). Nothing is asked to compute here: it might not finish in time."""
    env = {"BLOCKGRAD_REQUEST_TIMEOUT_S": str(SHORT_DEADLINE_S), "BLOCKGRAD_QUEUE_DEPTH": "1"}
    with gunicorn_server(workers=1, env=env) as server:
        yield server


@pytest.fixture(scope="module")
def impatient():
    """One worker with 1 s read and head timeouts (read_timeout): only bytes that never come
    meet them here."""
    env = {"BLOCKGRAD_READ_TIMEOUT_S": "1", "BLOCKGRAD_HEADER_TIMEOUT_S": "1"}
    with gunicorn_server(workers=1, env=env) as server:
        yield server


def test_unauthorized(edge):
    answer = post(edge, V1, GOOD)
    assert v1_error(answer, 401, "unauthorized")["message"] == \
        "This route needs the header `Authorization: Bearer <token>`."
    assert answer.headers["WWW-Authenticate"] == 'Bearer realm="blockgrad"'
    answer = post(edge, V1, GOOD, headers={"Authorization": "Bearer wrong"})
    v1_error(answer, 401, "unauthorized")
    assert answer.headers["WWW-Authenticate"] == 'Bearer realm="blockgrad", error="invalid_token"'
    v2_error(post(edge, V2, {}), 401, "unauthorized")
    v1_error(post(edge, JOBS, GOOD), 401, "unauthorized")
    for open_path in ("/healthz", "/metrics", "/openapi.json", "/v2/health/live"):  # probes, scrapers, docs
        assert requests.get(edge.url + open_path, timeout=WAIT_S).status_code == 200, open_path
    assert requests.get(edge.url + "/v1/objectives", headers=AUTH, timeout=WAIT_S).status_code == 200


def test_not_ready(edge):
    if torch.cuda.is_available():
        pytest.skip("BLOCKGRAD_DEVICE=cuda is usable on this machine")
    error = v1_error(requests.get(edge.url + "/readyz", timeout=WAIT_S), 503, "not_ready")
    assert "BLOCKGRAD_DEVICE=cuda" in error["message"]
    ready = requests.get(edge.url + "/v2/health/ready", timeout=WAIT_S)
    assert (ready.status_code, ready.content) == (400, b"")  # docs/api.md: 400, empty body
    body = {"vectors": [[1.0], [2.0]], "factor": 1}  # a request on that device: the same 503, not a 500
    error = v1_error(post(edge, V1, body, headers=AUTH), 503, "not_ready")
    assert "BLOCKGRAD_DEVICE=cuda" in error["message"]
    v2 = {"inputs": [{"name": "vectors", "datatype": "FP32", "shape": [2, 1], "data": [1.0, 2.0]}]}
    v2_error(post(edge, V2, v2, headers=AUTH), 503, "not_ready")


def test_cluster_unavailable_on_a_get(edge):
    """A GET of a job on a server without jobs (BLOCKGRAD_DASK_SCHEDULER=off)."""
    answer = requests.get(f"{edge.url}/v1/jobs/{'0' * 32}", headers=AUTH, timeout=WAIT_S)
    error = v1_error(answer, 503, "cluster_unavailable")
    assert error["details"] == {"scheduler": None}
    assert int(answer.headers["Retry-After"]) >= 1


def test_read_timeout(impatient):
    """A body that stops arriving, and a head that does (docs/api.md: 408, then the connection closes)."""
    raw = exchange(impatient.port, b"POST /v1/gradients HTTP/1.1\r\nHost: x\r\n"
                                   b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"vec")
    status, headers, body = head_and_body(raw)
    assert (status, headers[CODE_HEADER.lower()]) == (408, "read_timeout")
    assert json.loads(body)["error"]["details"] == {"timeout_s": 1.0}
    status, headers, body = head_and_body(exchange(impatient.port, b"POST /v1/gradients HTTP/1.1\r\nHost: x\r\n"))
    assert (status, headers[CODE_HEADER.lower()]) == (408, "read_timeout")
    assert "BLOCKGRAD_HEADER_TIMEOUT_S" in json.loads(body)["error"]["message"]


def test_predicted_over_the_deadline_is_limit_exceeded(short_deadline):
    # 67 million blocks of logsumexp: predicted at about 12 s by the default cost model (docs/performance.md).
    body = {"vectors": [[1.0] * 8] * 8192, "factor": 8192, "objective": "logsumexp", "outputs": ["accumulated"],
            "dtype": "float64"}
    error = v1_error(post(short_deadline, V1, body), 413, "limit_exceeded")
    assert error["details"]["limit"] == "BLOCKGRAD_REQUEST_TIMEOUT_S"
    assert error["details"]["deadline_s"] == SHORT_DEADLINE_S and error["details"]["predicted_s"] > SHORT_DEADLINE_S


def test_queue_full_overloaded_then_client_closed(edge):
    """With every compute slot held: one request waits (the queue's one place), the next is
    refused at once (503 overloaded); then the client of the one waiting half-closes, and it is
    dropped without a byte and logged as client_closed (status 499). The deadline is WAIT_S:
    the waiting request leaves the queue when its client goes, not when a clock runs out."""
    body = json.dumps(GOOD).encode()
    request_id = uuid.uuid4().hex
    with HeldSlots(edge) as held, socket.create_connection(("127.0.0.1", edge.port), timeout=WAIT_S) as sock:
        sock.sendall(f"POST /v1/gradients HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                     f"X-Request-ID: {request_id}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        assert wait_until(lambda: held.waiting() == 1, WAIT_S), "the request never waited for a slot"
        refused = post(edge, V1, data=body, headers={**AUTH, "Content-Type": "application/json"})
        assert v1_error(refused, 503, "overloaded")["details"] == {"queue_depth": 1}
        assert int(refused.headers["Retry-After"]) >= 1
        sock.shutdown(socket.SHUT_WR)
        try:
            assert sock.recv(65536) == b""  # closed without a byte
        except ConnectionResetError:
            pass
    line = f'"request_id":"{request_id}"'
    assert wait_until(lambda: line in edge.log(), WAIT_S)
    [logged] = [json.loads(text) for text in edge.log().splitlines() if line in text]
    assert (logged["status"], logged["error"]) == (499, "client_closed")
    metrics = requests.get(edge.url + "/metrics", timeout=WAIT_S).text
    assert re.search(r'blockgrad_errors_total\{code="client_closed"[^}]*\} [1-9]', metrics), metrics[-2000:]
    assert re.search(r'blockgrad_errors_total\{code="overloaded"[^}]*\} [1-9]', metrics)


def test_deadline_exceeded_in_the_queue(short_deadline):
    """With every compute slot held, a request leaves the queue only at its deadline: 503
    deadline_exceeded, details.queued. The deadline counts from its arrival, so one that
    reaches the queue late meets it there all the same: no margin decides the answer."""
    with HeldSlots(short_deadline):
        answer = post(short_deadline, V1, GOOD)
    error = v1_error(answer, 503, "deadline_exceeded")
    assert error["details"] == {"timeout_s": SHORT_DEADLINE_S, "queued": True}
    assert int(answer.headers["Retry-After"]) >= 1
