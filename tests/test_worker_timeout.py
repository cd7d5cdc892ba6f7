"""A worker killed by gunicorn's timeout is logged and counted as worker_timeout, never as
client_closed or a plain 200 (issue 11). Real gunicorn with a short `--timeout` and a
request many times longer (a slow reader, or a request held in the app by its own client)."""
import json
import os
import signal
import socket

import numpy as np
import orjson
import pytest

from tools.server import gunicorn_server, wait_until
from .events import in_flight_in

pytestmark = pytest.mark.slow

GUNICORN_TIMEOUT_S = 20  # a fresh worker must import torch within it, even on a busy machine
# Fast to compute (sum), but a streamed answer of ~20M numbers: far more than socket buffers hold.
LARGE_ANSWER = {"vectors": np.linspace(-1, 1, 400 * 64).reshape(400, 64).tolist(), "factor": 4}


@pytest.fixture(scope="module")
def metrics_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("metrics")


@pytest.fixture(scope="module")
def server(metrics_dir):
    # sync: a worker whose one thread is stuck writing misses its heartbeat, so gunicorn's
    # timeout is what ends a slow reader (a gthread worker's main loop keeps beating; gunicorn
    # runs gthread whenever threads > 1, hence --threads 1).
    env = {"GUNICORN_CMD_ARGS": f"--worker-class sync --threads 1 --timeout {GUNICORN_TIMEOUT_S}", "BLOCKGRAD_REQUEST_TIMEOUT_S": "600",
           "BLOCKGRAD_COST_PER_BLOCK_S": "1e-15", "BLOCKGRAD_COST_PER_NUMBER_S": "1e-15",  # admitted
           "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}  # read here while the one worker is held
    with gunicorn_server(workers=1, env=env) as server:
        yield server


def request_lines(server) -> list[dict]:
    lines = []
    for line in server.log().splitlines():
        if line.startswith("{") and '"logger":"blockgrad.request"' in line:
            lines.append(json.loads(line))
    return lines


def send_without_reading(server, body: dict) -> socket.socket:
    data = orjson.dumps(body)
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a reader that takes almost nothing
    sock.sendall(b"POST /v1/gradients HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(data) + data)
    return sock


def wait_for_line(server, request_id: str) -> dict:
    found = {}

    def logged():
        found.update(next((line for line in request_lines(server) if line["request_id"] == request_id), {}))
        return bool(found)
    assert wait_until(logged, 6 * GUNICORN_TIMEOUT_S, 0.5), server.log()[-3000:]
    return found


def test_worker_killed_while_a_slow_reader_holds_it_is_worker_timeout(server):
    body = dict(LARGE_ANSWER)
    sock = send_without_reading(server, body)
    try:
        sock.sendall(b"")
        # The request id is the server's; find the line by route and error instead.
        assert wait_until(lambda: any(line.get("error") == "worker_timeout" for line in request_lines(server)),
                          6 * GUNICORN_TIMEOUT_S, 0.5), server.log()[-3000:]
    finally:
        sock.close()
    line = next(line for line in request_lines(server) if line.get("error") == "worker_timeout")
    assert line["route"] == "/v1/gradients" and line["status"] == 200 and line["stream_aborted"] is True
    assert not any(line.get("error") == "client_closed" for line in request_lines(server))


def test_worker_aborted_before_answering_is_worker_timeout(server, metrics_dir):
    """gunicorn's master kills a silent worker with SIGABRT (arbiter.murder_workers); sent here
    directly while the request is held in the app (its body half sent), whatever the worker
    class, so the verdict does not depend on how long a computation takes."""
    assert wait_until(lambda: server.answers("/healthz"), 120, 0.5)  # the replacement worker is up
    pid = server.worker_pids()[0]
    assert wait_until(lambda: in_flight_in(metrics_dir) == 0, 30)  # nothing held before this one
    with socket.create_connection(("127.0.0.1", server.port), timeout=6 * GUNICORN_TIMEOUT_S) as sock:
        sock.sendall(b"POST /v1/gradients HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"X-Request-ID: aborted-early\r\nContent-Length: 1000\r\n\r\n{\"vectors\": [[1")
        # The app has the request (before_request ran) and waits for the rest of the body.
        assert wait_until(lambda: in_flight_in(metrics_dir) >= 1, 6 * GUNICORN_TIMEOUT_S), server.log()[-3000:]
        os.kill(pid, signal.SIGABRT)
        received = sock.recv(65536)  # gunicorn's own 500 page, or nothing
    assert received == b"" or received.startswith(b"HTTP/1.1 500")
    line = wait_for_line(server, "aborted-early")
    assert line["error"] == "worker_timeout" and line["status"] == 500 and "stream_aborted" not in line
    assert line["route"] == "/v1/gradients"
    metrics = requests_metrics(server)
    assert 'blockgrad_errors_total{code="worker_timeout"}' in metrics


def requests_metrics(server) -> str:
    import requests

    assert wait_until(lambda: server.answers("/healthz"), 120, 0.5)
    return requests.get(server.url + "/metrics", timeout=30).text
