"""What recycling guards against, measured: one worker's memory over many requests, recycling off.

`worker_memory_growth(bench)` sends REQUESTS requests on one keep-alive connection to a single
worker started as `make serve` starts it but with `--max-requests 0`: mostly the seed's 10 x 5
example, with larger pair matrices, `mean` and accumulated-only answers mixed in (MIX). The
worker's RSS after the first WARM_REQUESTS is the baseline; the row reports how far it moved
by the end (gunicorn.conf.py's max_requests rests on it: docs/serving.md).
`python -m bench worker_memory_growth`.
"""
import requests

from tools.server import gunicorn_server, rss_kib

from . import workloads
from .measure import Result

REQUESTS = 20_000
WARM_REQUESTS = 1_000
MIX = ([workloads.body(workloads.SEED_EXAMPLE, factor=2)] * 8
       + [workloads.body(workloads.vectors(64, 16, seed=1), factor=4),
          workloads.body(workloads.vectors(300, 32, seed=2), factor=3, outputs=["accumulated"]),
          workloads.body(workloads.vectors(37, 7, seed=3), factor=5, objective="mean")])


def worker_memory_growth(bench=None, requests_total: int = REQUESTS) -> list[Result]:
    """`bench` is unused (the row starts its own server); `requests_total` shortens a smoke run."""
    with gunicorn_server(workers=1, device="cpu", ready_path="/readyz",
                         env={"GUNICORN_CMD_ARGS": "--max-requests 0"}) as server, requests.Session() as session:
        [pid] = server.worker_pids()
        baseline_kib = None
        for k in range(requests_total):
            response = session.post(server.url + "/v1/gradients", data=MIX[k % len(MIX)], timeout=60,
                                    headers={"Content-Type": "application/json"})
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {response.content[:300]!r}")
            if k + 1 == min(WARM_REQUESTS, requests_total):
                baseline_kib = rss_kib(pid)
        final_kib = rss_kib(pid)
        if server.worker_pids() != [pid]:
            raise RuntimeError("the worker was replaced during the run")
    growth_mib = (final_kib - baseline_kib) / 1024
    return [Result(f"recycling: one worker's RSS over {requests_total} requests (recycling off)", "- (info)",
                   f"{growth_mib:+.1f} MiB", "-",
                   f"{baseline_kib / 1024:.0f} MiB after {min(WARM_REQUESTS, requests_total)} requests, "
                   f"{final_kib / 1024:.0f} MiB after {requests_total}; 8 in 11 the 10 x 5 example, the rest "
                   f"64 x 16, 300 x 32 (accumulated only), 37 x 7 (mean)")]


def large_requests_soak(bench=None, requests_total: int = 24) -> list[Result]:
    """Two workers as `make serve` starts them, large requests one after another (1024 x 32
    accumulated and losses; every third a 160 x 16 answered in blocks), after a warm-up of 8:
    the workers' summed RSS, mean of the last third against the first: an info row on whether
    their memory levels off. `python -m bench large_requests_soak`."""
    import numpy as np

    rng = np.random.default_rng(3)
    big = workloads.body(rng.standard_normal((1024, 32)), factor=8, outputs=["accumulated", "losses"])
    streamed = workloads.body(rng.standard_normal((160, 16)), factor=4)
    samples = []
    with gunicorn_server(workers=2) as server, requests.Session() as session:
        for k in range(8 + requests_total):
            response = session.post(server.url + "/v1/gradients", data=streamed if k % 3 == 2 else big, timeout=300,
                                    headers={"Content-Type": "application/json"})
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {response.content[:300]!r}")
            if k >= 8:
                samples.append(sum(rss_kib(pid) for pid in server.worker_pids()))
    third = len(samples) // 3
    first, last = sum(samples[:third]) / third, sum(samples[-third:]) / third
    return [Result(f"soak: two workers' RSS over {requests_total} large requests", "- (info)",
                   f"{last / first:.3f}x", "-",
                   f"{first / 1024:.0f} MiB (first third) to {last / 1024:.0f} MiB (last third), after 8 warm-up")]
