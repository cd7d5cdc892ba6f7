"""/metrics under a real gunicorn with two workers adds up both workers' counts.

The server runs with the project's gunicorn.conf.py on 127.0.0.1 and a free
port, PROMETHEUS_MULTIPROC_DIR in a temporary directory; the fixture starts and
stops it, and every wait is bounded.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
BODY = {"vectors": [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], "factor": 2, "outputs": ["accumulated", "losses"]}
BODY_NUMBERS = 3 * 2 + 2 * 2  # accumulated N*D + losses F*F
START_TIMEOUT_S = 120
BATCH, MAX_BATCHES, CLIENTS = 16, 10, 8


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def server(tmp_path):
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    (metrics_dir / "counter_1.db").write_bytes(b"stale")  # must be emptied at start
    port = free_port()
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(metrics_dir), BLOCKGRAD_BIND=f"127.0.0.1:{port}",
               WEB_CONCURRENCY="2", BLOCKGRAD_DEVICE="cpu")
    log_path = tmp_path / "gunicorn.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py", "wsgi:app"],
                                   cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert process.poll() is None, log_path.read_text()
            try:
                if requests.get(f"{base}/healthz", timeout=10).status_code == 200:
                    break
            except (requests.ConnectionError, requests.Timeout):  # not listening yet, or a worker still importing
                pass
            assert time.monotonic() < deadline, "gunicorn did not answer in time:\n" + log_path.read_text()
            time.sleep(0.2)
        yield base, process, metrics_dir, log_path
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def scrape(base):
    response = requests.get(f"{base}/metrics", timeout=10)
    assert response.status_code == 200
    return [sample for family in text_string_to_metric_families(response.text) for sample in family.samples]


def post_gradients(base, request_id):
    response = requests.post(f"{base}/v1/gradients", json=BODY, headers={"X-Request-ID": request_id}, timeout=30)
    assert response.status_code == 200 and response.headers["X-Request-ID"] == request_id
    return response


def test_metrics_add_up_both_workers(server):
    base, process, metrics_dir, log_path = server
    assert not (metrics_dir / "counter_1.db").exists()
    sent, worker_pids = 0, set()
    with ThreadPoolExecutor(CLIENTS) as pool:
        # Concurrent clients keep one worker busy while the other accepts, until both have served.
        for _ in range(MAX_BATCHES):
            list(pool.map(lambda k: post_gradients(base, f"mp-{k}"), range(sent, sent + BATCH)))
            sent += BATCH
            worker_pids = {sample.labels["pid"] for sample in scrape(base)
                           if sample.name == "blockgrad_device_info" and sample.labels["device"] == "cpu"}
            if len(worker_pids) == 2:
                break
    assert len(worker_pids) == 2, "one worker served every request"
    assert str(process.pid) not in worker_pids  # workers, not the master
    samples = scrape(base)
    ok = [s.value for s in samples if s.name == "blockgrad_requests_total"
          and s.labels == {"route": "/v1/gradients", "method": "POST", "status": "200"}]
    assert ok == [sent]  # one series, both workers' counts added
    [outputs] = [s.value for s in samples if s.name == "blockgrad_output_numbers_total"]
    assert outputs == sent * BODY_NUMBERS
    [latency] = [s.value for s in samples if s.name == "blockgrad_request_duration_seconds_count"
                 and s.labels == {"route": "/v1/gradients"}]
    assert latency == sent
    [in_flight] = [s.value for s in samples if s.name == "blockgrad_requests_in_flight"]
    assert in_flight == 1  # only this scrape
    # every worker wrote its own files into the directory gunicorn.conf.py prepared
    assert {path.name for path in metrics_dir.glob("counter_*.db")} == {f"counter_{pid}.db" for pid in worker_pids}

    process.send_signal(signal.SIGTERM)
    process.wait(timeout=30)
    assert not list(metrics_dir.glob("*.db"))  # cleaned on exit
    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    logged = {line["request_id"] for line in lines if line.get("route") == "/v1/gradients"}
    assert logged == {f"mp-{k}" for k in range(sent)}
    assert {line["n"] for line in lines if line.get("route") == "/v1/gradients"} == {3}
