"""Issue 19's metrics row: the multiprocess directory and /metrics while workers recycle.

`metrics_recycling_row(bench)` sends REQUESTS seed 10 x 5 requests from CLIENTS keep-alive
clients to gunicorn as `make serve` runs it, with workers recycled every ~100 requests
(RECYCLE_ARGS) and /metrics scraped every SCRAPE_EVERY_S; then counts the value files, compares
blockgrad_requests_total with the requests sent, and reads the scrapes' server-side times
from the request log.
"""
import json
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
from prometheus_client.parser import text_string_to_metric_families

from tools.server import gunicorn_server

from . import workloads
from .measure import Result, at_most

REQUESTS = 40_000
CLIENTS = 4
RECYCLE_ARGS = "--max-requests 100 --max-requests-jitter 10"
SCRAPE_EVERY_S = 0.25
MAX_DB_FILES = 24  # with 2 workers (issue 19)
MAX_SCRAPE_S = 0.010


def ok_requests(text: str) -> float:
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "blockgrad_requests_total" and sample.labels.get("route") == "/v1/gradients"
               and sample.labels.get("status") == "200")


def metrics_recycling_row(bench=None, requests_total: int = REQUESTS) -> list[Result]:
    """`bench` is unused (the row starts its own server); `requests_total` shortens a smoke run."""
    body = workloads.body(workloads.SEED_EXAMPLE, factor=2)
    headers = {"Content-Type": "application/json"}
    with tempfile.TemporaryDirectory() as metrics_dir, gunicorn_server(
            workers=None, device=None, ready_path="/readyz",
            env={"GUNICORN_CMD_ARGS": RECYCLE_ARGS, "PROMETHEUS_MULTIPROC_DIR": metrics_dir}) as server:
        stop, totals = threading.Event(), []

        def client(count: int) -> int:
            failed = 0
            with requests.Session() as session:
                for _ in range(count):
                    failed += session.post(server.url + "/v1/gradients", data=body, headers=headers,
                                           timeout=60).status_code != 200
            return failed

        def scraper() -> None:
            with requests.Session() as session:
                while not stop.wait(SCRAPE_EVERY_S):
                    totals.append(ok_requests(session.get(server.url + "/metrics", timeout=60).text))

        watcher = threading.Thread(target=scraper)
        watcher.start()
        start = time.perf_counter()
        try:
            with ThreadPoolExecutor(CLIENTS) as pool:
                shares = [requests_total // CLIENTS + (k < requests_total % CLIENTS) for k in range(CLIENTS)]
                failed = sum(pool.map(client, shares))
        finally:
            stop.set()
            watcher.join()
        wall = time.perf_counter() - start
        time.sleep(2)  # the last recycled worker's files folded
        files = list(Path(metrics_dir).rglob("*.db"))
        size_mb = sum(path.stat().st_size for path in files) / 1e6
        final = ok_requests(requests.get(server.url + "/metrics", timeout=60).text)
        lines = [json.loads(line) for line in server.log().splitlines() if line.startswith('{"ts"')]
        scrape_s = [line["duration_ms"] / 1e3 for line in lines if line.get("route") == "/metrics"]
        recycles = server.log().count("Autorestarting worker")
    monotonic = all(a <= b for a, b in zip(totals, totals[1:]))
    median_s = statistics.median(scrape_s[-20:])  # the last scrapes: after all the recycling
    exact = final == requests_total and failed == 0 and monotonic
    return [
        Result(f"19. metrics files after {requests_total} requests, workers recycling ({RECYCLE_ARGS})",
               f"<= {MAX_DB_FILES}", str(len(files)), at_most(len(files), MAX_DB_FILES),
               f"{recycles} recycles in {wall:.0f} s; {size_mb:.1f} MB"),
        Result("19. /metrics server-side median after that (request log)", f"< {MAX_SCRAPE_S * 1e3:.0f} ms",
               f"{median_s * 1e3:.1f} ms", at_most(median_s, MAX_SCRAPE_S),
               f"worst of {len(scrape_s)} scrapes during the run {max(scrape_s) * 1e3:.1f} ms"),
        Result("19. blockgrad_requests_total equals the requests sent", "exact", f"{final:.0f} of {requests_total}",
               "PASS" if exact else "MISS",
               f"{failed} failed requests; {len(totals)} scrapes, totals never went back: {monotonic}"),
    ]
