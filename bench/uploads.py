"""Small requests under dripping uploads: the 10 x 5 example on fresh connections every
0.25 s (alternately with Content-Length and chunked), its p99 latency while four uploads
send their bodies a byte a second (two declaring 32 MiB, two chunked) against the same
without them. Bounded in time: `seconds` per run, every request with a timeout.

    python -c "from bench.uploads import smoke; smoke()"   # a short run on its own server
"""
import socket
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import requests

from tools.server import Server, gunicorn_server

from . import workloads
from .measure import Result, at_most, ms

EVERY_S = 0.25
SECONDS = 10.0
REQUEST_TIMEOUT_S = 10.0
DECLARED_BYTES = 32 * 1024 * 1024


class DrippingUploads:
    """Four uploads to `server` sending one body byte a second until closed (at most `seconds`)."""

    def __init__(self, server: Server, seconds: float):
        self.socks: list[tuple[socket.socket, bool]] = []
        for is_chunked in (False, False, True, True):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
            framing = "Transfer-Encoding: chunked" if is_chunked else f"Content-Length: {DECLARED_BYTES}"
            sock.sendall(f"POST /v1/gradients HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                         f"{framing}\r\n\r\n".encode())
            self.socks.append((sock, is_chunked))
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.drip, args=(int(seconds) + 5,), daemon=True)
        self.thread.start()

    def drip(self, ticks: int) -> None:
        for _ in range(ticks):
            for sock, is_chunked in self.socks:
                try:
                    sock.sendall(b"1\r\n[\r\n" if is_chunked else b"[")
                except OSError:
                    pass
            if self.stop.wait(1.0):
                return

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        for sock, _ in self.socks:
            sock.close()


def one_request(url: str, body: bytes, is_chunked: bool) -> tuple[float, int | str]:
    """Seconds to a whole answer on a fresh connection, and its status (or the error's name)."""
    start = time.perf_counter()
    try:
        response = requests.post(url + "/v1/gradients", data=iter([body]) if is_chunked else body,
                                 headers={"Content-Type": "application/json"}, timeout=REQUEST_TIMEOUT_S)
        outcome: int | str = response.status_code
    except requests.RequestException as exc:
        outcome = type(exc).__name__
    return time.perf_counter() - start, outcome


def small_requests(server: Server, seconds: float = SECONDS) -> tuple[list[float], list[int | str]]:
    """The 10 x 5 example every EVERY_S for `seconds`: latencies of the 200s, and every outcome."""
    body = workloads.body(workloads.SEED_EXAMPLE)
    with ThreadPoolExecutor(max_workers=16) as pool:
        futures = []
        for tick in range(int(seconds / EVERY_S)):
            futures.append(pool.submit(one_request, server.url, body, tick % 2 == 1))
            time.sleep(EVERY_S)
        results = [future.result(timeout=REQUEST_TIMEOUT_S + 30) for future in futures]
    return [seconds for seconds, outcome in results if outcome == 200], [outcome for _, outcome in results]


def p99(latencies: list[float]) -> float:
    return float(np.percentile(latencies, 99)) if latencies else float("nan")


def dripping_uploads(server: Server, seconds: float = SECONDS) -> list[Result]:
    """The row: p99 of small requests under four dripping uploads against the same without them."""
    small_requests(server, 2.0)  # warm-up
    quiet, quiet_outcomes = small_requests(server, seconds)
    drips = DrippingUploads(server, seconds)
    try:
        time.sleep(1.5)  # each upload has sent a byte
        attacked, attacked_outcomes = small_requests(server, seconds)
    finally:
        drips.close()
    refused = [outcome for outcome in attacked_outcomes if outcome != 200]
    answered = len(attacked) / max(1, len(attacked_outcomes))
    return [Result("19. seed 10x5, fresh connection every 0.25 s, 4 dripping uploads: p99 (vs without)",
                   "<= 1 s, >= 99% 200", f"{ms(p99(attacked))}, {100 * answered:.0f}% 200",
                   "PASS" if at_most(p99(attacked), 1.0) == "PASS" and answered >= 0.99 else "MISS",
                   f"without uploads p99 {ms(p99(quiet))} ({len(quiet)}/{len(quiet_outcomes)} 200); "
                   f"with: median {ms(statistics.median(attacked)) if attacked else '-'}, "
                   f"not 200: {refused[:5]}{' ...' if len(refused) > 5 else ''}")]


def smoke(seconds: float = 3.0) -> list[Result]:
    """A short run on a server of its own (make serve's configuration), printed."""
    with gunicorn_server(workers=None, device=None, ready_path="/readyz") as server:
        results = dripping_uploads(server, seconds)
    for result in results:
        print(result)
    return results
