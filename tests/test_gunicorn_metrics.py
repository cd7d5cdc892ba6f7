"""/metrics under a real gunicorn with two workers adds up both workers' counts.

The server runs with the project's gunicorn.conf.py on 127.0.0.1 and a free
port, PROMETHEUS_MULTIPROC_DIR in a temporary directory; the fixture starts and
stops it, and every wait is bounded.
"""
import json
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tools.server import gunicorn_server

BODY = {"vectors": [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], "factor": 2, "outputs": ["accumulated", "losses"]}
BODY_NUMBERS = 3 * 2 + 2 * 2  # accumulated N*D + losses F*F
BATCH, MAX_BATCHES, CLIENTS = 16, 10, 8


@pytest.fixture
def server(tmp_path):
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    (metrics_dir / "counter_1.db").write_bytes(b"stale")  # must be emptied at start
    # Ready on /healthz: it records no device, so only /v1/gradients shows which workers served.
    with gunicorn_server(workers=2, env={"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}) as server:
        yield server.url, server.process, metrics_dir, server.log_path


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
