"""BLOCKGRAD_REQUEST_TIMEOUT_S: 503 before the stream starts, a cut stream after it,
and nothing of the request left in memory either way."""
import gc
import http.client
import json
import socket
import time
import weakref

import numpy as np
import pytest
import requests

import app.core.slots as deadline_module
import app.core.run as compute
from app import create_app
from app.core.errors import BlockgradError, deadline_exceeded
from app.core.engine import DEFAULT_CHUNK_ELEMENTS, plan_bands
from app.core.slots import Deadline

from tools.server import gunicorn_server, wait_until
from .events import reached_the_app
from .test_api import GOOD, assert_error, assert_still_serving, strict_json


@pytest.fixture
def tensor_refs(monkeypatch):
    """Weak references to every request's vectors tensor, to prove it is freed."""
    refs = []
    real_load = compute.load_vectors

    def load_and_watch(req, device):
        vectors = real_load(req, device)
        refs.append(weakref.ref(vectors))
        return vectors
    monkeypatch.setattr(compute, "load_vectors", load_and_watch)
    return refs


def assert_freed(refs):
    gc.collect()
    assert refs and all(ref() is None for ref in refs), "a request's tensors outlived it"


# The cost model predicts every request here as (almost) instant, so that compute admission
# (413 for what cannot finish in time) lets them through to the deadline they test.
PREDICTED_INSTANT = {"BLOCKGRAD_COST_PER_BLOCK_S": "1e-15", "BLOCKGRAD_COST_PER_NUMBER_S": "1e-15"}


def test_deadline_before_streaming_is_503_with_retry_after(tensor_refs):
    client = create_app({"BLOCKGRAD_REQUEST_TIMEOUT_S": 1e-9, **PREDICTED_INSTANT}).test_client()
    response = client.post("/v1/gradients", json={"vectors": [[1.0]] * 8, "factor": 8})
    error = assert_error(response, 503, "deadline_exceeded")
    assert int(response.headers["Retry-After"]) >= 1
    assert error["details"] == {"timeout_s": 1e-9}
    assert_freed(tensor_refs)


class ExpiresAfter(Deadline):
    """A deadline that passes after a fixed number of checks (no clocks in tests)."""
    checks_allowed = 0

    def check(self):
        type(self).checks_allowed -= 1
        if type(self).checks_allowed < 0:
            raise deadline_exceeded(self.timeout_s)


# Dense gradients (sum_of_squares) over a keep budget of 2048 numbers: recomputed as written,
# so the computation, and its deadline, lasts until the last block. 16384 block numbers: over
# WHOLE_ANSWER_NUMBERS, so a /v1 answer streams.
N, FACTOR, RECOMPUTED = 64, 4, {"TESTING": True, "BLOCKGRAD_MAX_BLOCK_ELEMENTS": 2048}


def expire_after_pass_one_and_two_blocks(monkeypatch) -> None:
    """All of pass one (one check per band of chunks), then two blocks of pass two."""
    ExpiresAfter.checks_allowed = len(list(plan_bands(N, 2, FACTOR, 2048))) + 2
    monkeypatch.setattr(deadline_module, "Deadline", ExpiresAfter)


def read_until_cut(response) -> bytes:
    chunks = []
    with pytest.raises(BlockgradError, match="did not finish"):
        for chunk in response.response:
            chunks.append(chunk)
    response.close()
    return b"".join(chunks)


def test_deadline_mid_stream_cuts_the_body(monkeypatch, tensor_refs):
    expire_after_pass_one_and_two_blocks(monkeypatch)
    client = create_app(RECOMPUTED).test_client()
    response = client.post("/v1/gradients", json={"vectors": np.ones((N, 2)).tolist(), "factor": FACTOR,
                                                  "objective": "sum_of_squares", "outputs": ["blocks"]})
    assert response.status_code == 200  # the head had gone out; the status cannot change now
    body = read_until_cut(response)
    assert body.startswith(b'{"n":64,')
    with pytest.raises(ValueError):
        strict_json(body)  # incomplete, never a complete-looking wrong answer
    assert_freed(tensor_refs)
    monkeypatch.undo()
    assert_still_serving(client)


def test_deadline_while_a_v2_grid_is_recomputed_cuts_the_binary_body(monkeypatch, tensor_refs):
    """block_gradients is made as it is written: a deadline then ends the body short of its
    Content-Length (the client can tell), and the request's tensors are freed."""
    from blockgrad_client.infer import binary_infer_request

    expire_after_pass_one_and_two_blocks(monkeypatch)
    client = create_app(RECOMPUTED).test_client()
    body, headers = binary_infer_request(np.ones((N, 2)), {"factor": FACTOR, "objective": "sum_of_squares"},
                                         ["block_gradients"])
    response = client.post("/v2/models/blockgrad/infer", data=body, headers=headers)
    assert response.status_code == 200
    assert 0 < len(read_until_cut(response)) < int(response.headers["Content-Length"])
    assert_freed(tensor_refs)
    monkeypatch.undo()
    assert_still_serving(client)


@pytest.mark.parametrize("n", [8, 64])  # a small answer sent whole, a larger one streamed
def test_kept_blocks_are_written_whole_whatever_the_deadline(monkeypatch, n):
    """Blocks kept from pass one are only written: the deadline is for computing, not for the
    client's download, so one that passes after pass one does not cut them."""
    vectors = np.arange(n * 2, dtype=np.float64).reshape(n, 2).tolist()
    document = {"vectors": vectors, "factor": 4, "outputs": ["blocks", "accumulated"]}
    client = create_app({"TESTING": True}).test_client()
    expected = client.post("/v1/gradients", json=document).get_data()
    ExpiresAfter.checks_allowed = len(list(plan_bands(n, 2, 4, DEFAULT_CHUNK_ELEMENTS)))  # nothing after pass one
    monkeypatch.setattr(deadline_module, "Deadline", ExpiresAfter)
    response = client.post("/v1/gradients", json=document)
    assert response.status_code == 200 and response.get_data() == expected


# Against a real gunicorn: one worker, a 2 s deadline and an API token (also proving
# the token never reaches the server's log).
TOKEN = "t0ken-that-must-not-be-logged"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
DEADLINE_S = 2


@pytest.fixture(scope="module")
def short_deadline_server():
    with gunicorn_server(workers=1, env={"BLOCKGRAD_REQUEST_TIMEOUT_S": str(DEADLINE_S), "BLOCKGRAD_API_TOKEN": TOKEN,
                                         **PREDICTED_INSTANT}) as server:
        yield server
        assert TOKEN not in server.log()


@pytest.mark.slow
def test_gunicorn_answers_503_before_streaming(short_deadline_server):
    """The deadline counts from the request's arrival, reading the body included. The client
    sends half the body, waits until the request is in the app, and withholds the rest for
    twice the deadline: however fast the machine, the request cannot be answered in time."""
    server = short_deadline_server
    body = json.dumps({"vectors": np.ones((64, 4)).tolist(), "factor": 4, "outputs": ["accumulated"]}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.putrequest("POST", "/v1/gradients")
        for name, value in {"Content-Type": "application/json", "Content-Length": str(len(body)), **AUTH}.items():
            conn.putheader(name, value)
        conn.endheaders(body[:len(body) // 2])
        assert wait_until(reached_the_app(server), 30), "the request did not reach the app"
        time.sleep(2 * DEADLINE_S)  # the client's own pace: the server has nothing to compute yet
        conn.send(body[len(body) // 2:])
        response = conn.getresponse()
        assert response.status == 503
        assert json.loads(response.read())["error"]["code"] == "deadline_exceeded"
        assert int(response.getheader("Retry-After")) >= 1
    finally:
        conn.close()
    ok = requests.post(server.url + "/v1/gradients", json=GOOD, headers=AUTH, timeout=30)
    assert ok.status_code == 200 and ok.json()["n"] == 3


@pytest.mark.slow
def test_gunicorn_cuts_a_stream_that_passes_the_deadline(short_deadline_server):
    """A slow reader: the worker blocks on a full socket, the deadline passes, the
    stream is cut without its final chunk and the client's parser fails."""
    # Dense gradients over the keep budget: recomputed as they are written, so still computing.
    body = json.dumps({"vectors": np.ones((512, 16)).tolist(), "factor": 16, "objective": "sum_of_squares",
                       "outputs": ["blocks"]})
    conn = http.client.HTTPConnection("127.0.0.1", short_deadline_server.port, timeout=30)
    try:
        conn.connect()
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)  # a slow, small reader
        conn.request("POST", "/v1/gradients", body=body,
                     headers={"Content-Type": "application/json", **AUTH})
        response = conn.getresponse()  # status and headers: the head was sent first
        assert response.status == 200
        assert response.getheader("Transfer-Encoding") == "chunked"
        # A reader at most 64 KiB per 50 ms: the ~34 MB answer would take over 25 s to read,
        # more than ten times the deadline, however fast the server.
        pieces = []
        with pytest.raises(http.client.IncompleteRead) as cut:
            for _ in range(4000):
                piece = response.read(64 * 1024)
                if not piece:
                    break
                pieces.append(piece)
                time.sleep(0.05)
        partial = b"".join(pieces) + cut.value.partial
        assert partial.startswith(b'{"n":512,')
        with pytest.raises(ValueError):
            strict_json(partial)
    finally:
        conn.close()
    ok = requests.post(short_deadline_server.url + "/v1/gradients", json=GOOD, headers=AUTH, timeout=30)
    assert ok.status_code == 200  # the same worker serves on
    assert "deadline" in short_deadline_server.log().lower()
