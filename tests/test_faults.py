"""Faults against a real gunicorn with two workers: a killed worker, a burst, a soak,
and a graceful SIGTERM (last: it stops the server)."""
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
import torch

from tools.reference import reference_accumulated
from tools.server import gunicorn_server, rss_kib, wait_until
from .test_api import GOOD

pytestmark = pytest.mark.slow

# N = 4096, D = 64: 2.1 billion numbers of blocks run for seconds (the engine's cost follows
# the numbers, not the blocks); with the `sum` objective every accumulated entry is 2N (each
# vector is in N row and N column pairs).
N_LONG = 4096
LONG = {"vectors": np.linspace(-1, 1, N_LONG * 64).reshape(N_LONG, 64).tolist(), "factor": 64,
        "outputs": ["accumulated"]}
LONG_MEDIUM = dict(LONG, vectors=np.linspace(-1, 1, N_LONG * 16).reshape(N_LONG, 16).tolist())  # a few seconds
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


def test_sigkill_of_a_worker_fails_only_its_request(server):
    workers_before = set(server.worker_pids())
    long = in_background(lambda: post(server, LONG))
    victim = server.busy_worker()
    assert victim in workers_before, "no worker picked up the long request"
    os.kill(victim, signal.SIGKILL)
    long["thread"].join(TIMEOUT_S)
    assert isinstance(long.get("error"), requests.ConnectionError), long
    # The master replaces the worker by itself.
    assert wait_until(lambda: len(set(server.worker_pids()) - {victim}) == 2, 30), server.log()
    assert victim not in server.worker_pids()
    for _ in range(50):
        response = post(server, GOOD, timeout=30)
        assert response.status_code == 200 and response.json()["n"] == 3


def test_a_burst_larger_than_the_workers_is_all_answered(server):
    rng = np.random.default_rng(7)
    bodies = [{"vectors": rng.standard_normal((12, 3)).tolist(), "factor": 1 + k % 4,
               "objective": "sum_of_squares", "outputs": ["accumulated"], "dtype": "float64"}
              for k in range(12)]  # 12 at once against 2 workers
    with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
        responses = list(pool.map(lambda body: post(server, body, timeout=60), bodies))
    for body, response in zip(bodies, responses):
        assert response.status_code == 200
        expected = reference_accumulated(torch.tensor(body["vectors"], dtype=torch.float64), body["factor"],
                                          "sum_of_squares")
        torch.testing.assert_close(torch.tensor(response.json()["accumulated"], dtype=torch.float64), expected)


def test_soak_worker_memory_levels_off(server):
    """A bounded loop of large requests: the workers' RSS grows under 10% between the
    mean of the first and the last third (after a warm-up that fills the allocator)."""
    rng = np.random.default_rng(3)
    big = {"vectors": rng.standard_normal((1024, 32)).tolist(), "factor": 8, "outputs": ["accumulated", "losses"]}
    streamed = {"vectors": rng.standard_normal((160, 16)).tolist(), "factor": 4}  # ~0.8M numbers in blocks
    for body in (big, streamed) * 2:  # warm-up, not measured
        assert post(server, body).status_code == 200
    samples = []
    for k in range(24):
        response = post(server, streamed if k % 3 == 2 else big)
        assert response.status_code == 200
        samples.append(sum(rss_kib(pid) for pid in server.worker_pids()))
    third = len(samples) // 3
    first, last = np.mean(samples[:third]), np.mean(samples[-third:])
    assert last < 1.10 * first, f"worker RSS grew from {first:.0f} KiB to {last:.0f} KiB: {samples}"


def test_sigterm_lets_the_request_in_flight_finish(server):
    """Runs last: it stops the module's server."""
    long = in_background(lambda: post(server, LONG_MEDIUM))
    assert server.busy_worker() is not None, "no worker picked up the request"
    os.kill(server.pid, signal.SIGTERM)  # the master only, as an orchestrator would
    long["thread"].join(TIMEOUT_S)
    response = long.get("result")
    assert response is not None and response.status_code == 200, long
    assert np.all(np.array(response.json()["accumulated"]) == 2 * N_LONG)
    assert server.process.wait(30) == 0
    assert not server.worker_pids()
