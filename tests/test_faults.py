"""Faults against a real gunicorn with two workers: a killed worker, a burst, and a graceful
SIGTERM (on a server of its own: it stops it). Whether memory levels off under large requests
is an info row of `make bench` (bench/worker_growth.py: large_requests_soak)."""
import http.client
import json
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
import torch

from tools.reference import reference_accumulated
from tools.server import gunicorn_server, wait_until
from .numeric import assert_matches
from .events import accepting, connection_owner, reached_the_app, workers_listening
from .test_api import GOOD

pytestmark = pytest.mark.slow

TIMEOUT_S = 120  # bound of every wait below; reached only on failure
# GOOD's whole answer: objective sum, float32, outputs blocks and accumulated. A block's loss is
# the sum of its pairs' entries plus the offset 5 per entry (vector sums 3, 7, 11), every
# gradient entry is 1, and each vector is in 2N = 6 pairs' halves.
GOOD_ANSWER = {
    "n": 3, "dim": 2, "factor": 2, "bounds": [0, 1, 3], "objective": "sum", "dtype": "float32", "device": "cpu",
    "accumulated": [[6.0, 6.0]] * 3,
    "blocks": [
        {"row": 0, "col": 0, "rows": [0, 1], "cols": [0, 1], "loss": 6.0 + 4 * 5, "gradient": [[[1.0] * 4]]},
        {"row": 0, "col": 1, "rows": [0, 1], "cols": [1, 3], "loss": 10.0 + 14.0 + 8 * 5,
         "gradient": [[[1.0] * 4] * 2]},
        {"row": 1, "col": 0, "rows": [1, 3], "cols": [0, 1], "loss": 10.0 + 14.0 + 8 * 5,
         "gradient": [[[1.0] * 4]] * 2},
        {"row": 1, "col": 1, "rows": [1, 3], "cols": [1, 3], "loss": 14.0 + 18.0 + 18.0 + 22.0 + 16 * 5,
         "gradient": [[[1.0] * 4] * 2] * 2},
    ],
}


@pytest.fixture(scope="module")
def server():
    with gunicorn_server(workers=2) as server:
        yield server


def post(server, body, timeout=TIMEOUT_S):
    return requests.post(server.url + "/v1/gradients", json=body, timeout=timeout)


def in_background(fn):
    """Run `fn` in a thread; the returned dict gets "result" or "error"."""
    outcome = {}

    def run():
        try:
            outcome["result"] = fn()
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            outcome["error"] = exc
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    outcome["thread"] = thread
    return outcome


def open_request(server, body: bytes) -> http.client.HTTPConnection:
    """A request whose body is sent only up to its half: held in flight by its own client."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=TIMEOUT_S)
    conn.putrequest("POST", "/v1/gradients")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(len(body)))
    conn.endheaders(body[:len(body) // 2])
    return conn


def test_sigkill_of_a_worker_fails_only_its_request(server):
    """The request is held in flight by its client (half a body), so that the worker is
    killed mid-request however fast it computes; the worker is the one holding its socket."""
    workers_before = set(server.worker_pids())
    body = json.dumps(GOOD).encode()
    conn = open_request(server, body)
    try:
        assert wait_until(reached_the_app(server), TIMEOUT_S), "no worker picked up the request"
        assert wait_until(lambda: connection_owner(server, conn.sock) is not None, TIMEOUT_S)
        victim = connection_owner(server, conn.sock)
        assert victim in workers_before
        os.kill(victim, signal.SIGKILL)
        with pytest.raises((OSError, http.client.HTTPException)):  # reset or closed: never an answer
            conn.send(body[len(body) // 2:])
            conn.getresponse()
    finally:
        conn.close()
    # The master replaces the worker by itself.
    assert wait_until(lambda: len(set(server.worker_pids()) - {victim}) == 2, TIMEOUT_S), server.log()
    assert victim not in server.worker_pids()
    for _ in range(50):  # both workers, the new one too, answer whole and right
        response = post(server, GOOD)
        assert response.status_code == 200 and response.json() == GOOD_ANSWER


def post_retrying(server, body):
    """As a caller should: a 503 `overloaded` is retried after its Retry-After (bounded)."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        response = post(server, body)
        if response.status_code != 503 or response.json()["error"]["code"] != "overloaded" \
                or time.monotonic() > deadline:
            return response
        time.sleep(int(response.headers["Retry-After"]))


def test_a_burst_larger_than_the_workers_is_all_answered(server):
    rng = np.random.default_rng(7)
    bodies = [{"vectors": rng.standard_normal((12, 3)).tolist(), "factor": 1 + k % 4,
               "objective": "sum_of_squares", "outputs": ["accumulated"], "dtype": "float64"}
              for k in range(12)]  # 12 at once against 2 workers
    with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
        responses = list(pool.map(lambda body: post_retrying(server, body), bodies))
    for body, response in zip(bodies, responses):
        assert response.status_code == 200
        expected = reference_accumulated(torch.tensor(body["vectors"], dtype=torch.float64), body["factor"],
                                          "sum_of_squares")
        assert_matches(response.json()["accumulated"], expected, "float64")


@pytest.fixture
def own_server():
    """A server of the test's own: SIGTERM stops it, whatever runs after."""
    with gunicorn_server(workers=2) as server:
        yield server


def test_sigterm_lets_the_request_in_flight_finish(own_server):
    """The request is held in flight by its own client, which sends the body in two halves
    around the SIGTERM: nothing here depends on how fast the machine computes (a long
    computation racing the 60 s deadline did)."""
    server = own_server
    body = json.dumps({"vectors": np.linspace(-1, 1, 40 * 3).reshape(40, 3).tolist(), "factor": 4,
                       "objective": "sum_of_squares", "outputs": ["accumulated"], "dtype": "float64"}).encode()
    half = len(body) // 2
    conn = open_request(server, body)
    try:
        # In flight once its worker has started it (the gauge counts the scrape too).
        assert wait_until(reached_the_app(server), TIMEOUT_S), "no worker picked up the request"
        workers = server.worker_pids()
        # The idle worker accepts; the one serving leaves new connections to it (docs/cores.md).
        # Waited for, not sampled: a worker answering the scrape, or deferring a connection to
        # its sibling, stops polling the listener for a moment.
        assert workers and wait_until(lambda: any(accepting(pid, server.port) for pid in workers), TIMEOUT_S)
        os.kill(server.pid, signal.SIGTERM)  # the master only, as an orchestrator would
        # Every worker has begun its graceful stop (closed its listener) while the body is still incomplete.
        assert wait_until(lambda: not workers_listening(server, workers), TIMEOUT_S), \
            server.log()
        conn.send(body[half:])
        response = conn.getresponse()
        assert response.status == 200
        expected = reference_accumulated(torch.tensor(json.loads(body)["vectors"], dtype=torch.float64), 4,
                                         "sum_of_squares")
        assert_matches(json.loads(response.read())["accumulated"], expected, "float64")
    finally:
        conn.close()
    assert server.process.wait(TIMEOUT_S) == 0
    assert not server.worker_pids()

