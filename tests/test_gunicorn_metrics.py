"""/metrics under a real gunicorn with two workers adds up both workers' counts.

The server runs with the project's gunicorn.conf.py on 127.0.0.1 and a free
port, PROMETHEUS_MULTIPROC_DIR in a temporary directory; the fixture starts and
stops it, and every wait is bounded.
"""
import json
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tools.server import gunicorn_server, wait_until

pytestmark = pytest.mark.slow

BODY = {"vectors": [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], "factor": 2, "outputs": ["accumulated", "losses"]}
BODY_NUMBERS = 3 * 2 + 2 * 2  # accumulated N*D + losses F*F
BATCH, CLIENTS = 16, 8
WAIT_S = 120  # bound of every wait below; reached only on failure


@pytest.fixture
def server(tmp_path):
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    (metrics_dir / "counter_1.db").write_bytes(b"stale")  # must be emptied at start
    # Ready on /healthz: it records no device, so only /v1/gradients shows which workers served.
    with gunicorn_server(workers=2, env={"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}) as server:
        yield server.url, server.process, metrics_dir, server.log_path


def scrape(base):
    response = requests.get(f"{base}/metrics", timeout=WAIT_S)
    assert response.status_code == 200
    return [sample for family in text_string_to_metric_families(response.text) for sample in family.samples]


def post_gradients(base, request_id):
    response = requests.post(f"{base}/v1/gradients", json=BODY, headers={"X-Request-ID": request_id}, timeout=WAIT_S)
    assert response.status_code == 200 and response.headers["X-Request-ID"] == request_id
    return response


def test_metrics_add_up_both_workers(server):
    base, process, metrics_dir, log_path = server
    assert not (metrics_dir / "counter_1.db").exists()
    sent, worker_pids = 0, set()

    def both_served() -> bool:
        """Another batch of concurrent clients (one keeps a worker busy while the other accepts):
        have both workers served by now? How many batches that takes is the machine's pace."""
        nonlocal sent, worker_pids
        list(pool.map(lambda k: post_gradients(base, f"mp-{k}"), range(sent, sent + BATCH)))
        sent += BATCH
        worker_pids = {sample.labels["pid"] for sample in scrape(base)
                       if sample.name == "blockgrad_device_info" and sample.labels["device"] == "cpu"}
        return len(worker_pids) == 2
    with ThreadPoolExecutor(CLIENTS) as pool:
        assert wait_until(both_served, WAIT_S, 0), f"one worker served all {sent} requests"
    assert str(process.pid) not in worker_pids  # workers, not the master
    # Each request leaves the gauge once answered, maybe just after its client has the answer.
    assert wait_until(lambda: in_flight(scrape(base)) == 1, WAIT_S), "a request stayed in the gauge"
    samples = scrape(base)
    ok = [s.value for s in samples if s.name == "blockgrad_requests_total"
          and s.labels == {"route": "/v1/gradients", "method": "POST", "status": "200"}]
    assert ok == [sent]  # one series, both workers' counts added
    [outputs] = [s.value for s in samples if s.name == "blockgrad_output_numbers_total"]
    assert outputs == sent * BODY_NUMBERS
    [latency] = [s.value for s in samples if s.name == "blockgrad_request_duration_seconds_count"
                 and s.labels == {"route": "/v1/gradients"}]
    assert latency == sent
    # every worker wrote its own files into the directory gunicorn.conf.py prepared
    assert {path.name for path in metrics_dir.glob("counter_*.db")} == {f"counter_{pid}.db" for pid in worker_pids}

    process.send_signal(signal.SIGTERM)
    process.wait(timeout=WAIT_S)
    assert not list(metrics_dir.glob("*.db"))  # cleaned on exit
    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    logged = {line["request_id"] for line in lines if line.get("route") == "/v1/gradients"}
    assert logged == {f"mp-{k}" for k in range(sent)}
    assert {line["n"] for line in lines if line.get("route") == "/v1/gradients"} == {3}


RECYCLED_REQUESTS, RECYCLING_CLIENTS = 2000, 4
RECYCLE_ARGS = "--max-requests 100 --max-requests-jitter 10"


def live_worker_files_only(metrics_dir, worker_pids) -> bool:
    """Every value file, subdirectories included, is an archive or a live worker's."""
    owners = {path.stem.rpartition("_")[2] for path in metrics_dir.rglob("*.db")}
    return owners <= {"archive", *map(str, worker_pids)}


def test_recycled_workers_keep_their_counts_and_leave_no_files(tmp_path):
    """Workers recycling every ~100 requests while keep-alive clients send RECYCLED_REQUESTS and
    /metrics is scraped throughout: no request fails, no scrape sees a total go back, and at
    the end every total is exact and the directory holds only the live workers' files and the
    archives."""
    metrics_dir = tmp_path / "metrics"
    env = {"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir), "GUNICORN_CMD_ARGS": RECYCLE_ARGS}
    with gunicorn_server(workers=2, env=env) as srv:
        first = set(srv.worker_pids())
        scraped, stop = [], threading.Event()

        def client(k):
            with requests.Session() as session:
                return [session.post(f"{srv.url}/v1/gradients", json=BODY, timeout=WAIT_S).status_code
                        for _ in range(RECYCLED_REQUESTS // RECYCLING_CLIENTS)]

        def scraper():
            with requests.Session() as session:
                for _ in range(100_000):  # bounded; ends when the clients are done
                    try:
                        response = session.get(f"{srv.url}/metrics", timeout=WAIT_S)
                        scraped.append(ok_requests(response.text) if response.status_code == 200 else None)
                    except Exception as exc:  # noqa: BLE001 - a failed scrape fails the test below
                        scraped.append(exc)
                    if stop.wait(0.05):
                        return

        watcher = threading.Thread(target=scraper)
        watcher.start()
        try:
            with ThreadPoolExecutor(RECYCLING_CLIENTS) as pool:
                statuses = [status for batch in pool.map(client, range(RECYCLING_CLIENTS)) for status in batch]
        finally:
            stop.set()
            watcher.join(WAIT_S)
        assert statuses == [200] * RECYCLED_REQUESTS
        recycles = srv.log().count("Autorestarting worker")
        assert recycles >= 5 and not first & set(srv.worker_pids())
        errors = [line for line in srv.log().splitlines() if "Traceback" in line or "Error" in line]
        assert len(scraped) > 10 and all(isinstance(total, (int, float)) for total in scraped), (scraped, errors[-20:])
        assert all(a <= b for a, b in zip(scraped, scraped[1:])), "a total went back"

        assert wait_until(lambda: len(srv.worker_pids()) == 2
                          and live_worker_files_only(metrics_dir, srv.worker_pids()), WAIT_S)
        files = list(metrics_dir.rglob("*.db"))
        assert len(files) <= 6 * 2 + 3, sorted(path.name for path in files)  # the value files of a few kinds per worker, the archives
        samples = scrape(srv.url)
        assert ok_requests_of(samples) == RECYCLED_REQUESTS
        [latency] = [s.value for s in samples if s.name == "blockgrad_request_duration_seconds_count"
                     and s.labels == {"route": "/v1/gradients"}]
        assert latency == RECYCLED_REQUESTS
        [outputs] = [s.value for s in samples if s.name == "blockgrad_output_numbers_total"]
        assert outputs == RECYCLED_REQUESTS * BODY_NUMBERS


def in_flight(samples) -> float:
    """blockgrad_requests_in_flight summed over the workers (the scrape counts itself)."""
    [value] = [s.value for s in samples if s.name == "blockgrad_requests_in_flight"]
    return value


def ok_requests_of(samples) -> float:
    return sum(s.value for s in samples if s.name == "blockgrad_requests_total"
               and s.labels == {"route": "/v1/gradients", "method": "POST", "status": "200"})


def ok_requests(text: str) -> float:
    return ok_requests_of([s for family in text_string_to_metric_families(text) for s in family.samples])
