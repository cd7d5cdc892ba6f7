"""Faults against a real gunicorn with two workers: a killed worker, a burst, a soak,
and a graceful SIGTERM (last: it stops the server)."""
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
from tools.server import gunicorn_server, rss_kib, wait_until
from .numeric import assert_matches
from .events import accepting, connection_owner, reached_the_app
from .test_api import GOOD

pytestmark = pytest.mark.slow

TIMEOUT_S = 120


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
        assert wait_until(reached_the_app(server), 30), "no worker picked up the request"
        assert wait_until(lambda: connection_owner(server, conn.sock) is not None, 30)
        victim = connection_owner(server, conn.sock)
        assert victim in workers_before
        os.kill(victim, signal.SIGKILL)
        with pytest.raises((OSError, http.client.HTTPException)):  # reset or closed: never an answer
            conn.send(body[len(body) // 2:])
            conn.getresponse()
    finally:
        conn.close()
    # The master replaces the worker by itself.
    assert wait_until(lambda: len(set(server.worker_pids()) - {victim}) == 2, 30), server.log()
    assert victim not in server.worker_pids()
    for _ in range(50):
        response = post(server, GOOD, timeout=30)
        assert response.status_code == 200 and response.json()["n"] == 3


def post_retrying(server, body, attempts=20):
    """As a caller should: a 503 `overloaded` is retried after its Retry-After (bounded)."""
    for _ in range(attempts):
        response = post(server, body, timeout=60)
        if response.status_code != 503 or response.json()["error"]["code"] != "overloaded":
            return response
        time.sleep(int(response.headers["Retry-After"]))
    return response


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


def test_soak_worker_memory_levels_off(server):
    """A bounded loop of large requests: the workers' RSS grows under 10% between the
    mean of the first and the last third (after a warm-up that fills the allocator)."""
    rng = np.random.default_rng(3)
    big = {"vectors": rng.standard_normal((1024, 32)).tolist(), "factor": 8, "outputs": ["accumulated", "losses"]}
    streamed = {"vectors": rng.standard_normal((160, 16)).tolist(), "factor": 4}  # ~0.8M numbers in blocks
    # Warm-up, not measured: gthread serves requests on different pool threads, and
    # the worker's malloc arena (gunicorn.conf.py) has to reach its working size.
    for body in (big, streamed) * 4:
        response = post(server, body)
        assert response.status_code == 200, response.text
    samples = []
    for k in range(24):
        response = post(server, streamed if k % 3 == 2 else big)
        assert response.status_code == 200, response.text
        samples.append(sum(rss_kib(pid) for pid in server.worker_pids()))
    third = len(samples) // 3
    first, last = np.mean(samples[:third]), np.mean(samples[-third:])
    assert last < 1.10 * first, f"worker RSS grew from {first:.0f} KiB to {last:.0f} KiB: {samples}"


def test_sigterm_lets_the_request_in_flight_finish(server):
    """Runs last: it stops the module's server. The request is held in flight by its own
    client, which sends the body in two halves around the SIGTERM: nothing here depends on
    how fast the machine computes (a long computation racing the 60 s deadline did)."""
    body = json.dumps({"vectors": np.linspace(-1, 1, 40 * 3).reshape(40, 3).tolist(), "factor": 4,
                       "objective": "sum_of_squares", "outputs": ["accumulated"], "dtype": "float64"}).encode()
    half = len(body) // 2
    conn = open_request(server, body)
    try:
        # In flight once its worker has started it (the gauge counts the scrape too).
        assert wait_until(reached_the_app(server), 30), "no worker picked up the request"
        workers = server.worker_pids()
        # The idle worker accepts; the one serving leaves new connections to it (docs/cores.md).
        assert workers and any(accepting(pid, server.port) for pid in workers)
        os.kill(server.pid, signal.SIGTERM)  # the master only, as an orchestrator would
        # Every worker has begun its graceful stop (stopped accepting) while the body is still incomplete.
        assert wait_until(lambda: not any(accepting(pid, server.port) for pid in workers), 30), server.log()
        conn.send(body[half:])
        response = conn.getresponse()
        assert response.status == 200
        expected = reference_accumulated(torch.tensor(json.loads(body)["vectors"], dtype=torch.float64), 4,
                                         "sum_of_squares")
        assert_matches(json.loads(response.read())["accumulated"], expected, "float64")
    finally:
        conn.close()
    assert server.process.wait(30) == 0
    assert not server.worker_pids()

