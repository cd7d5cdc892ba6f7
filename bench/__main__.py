"""`python -m bench`: start the service as `make serve` does, run every row, print the table.

Usage: python -m bench [ROW ...]   (ROW: a row function's name, e.g. http_vs_floor; default all)
"""
import argparse
import datetime
import os
import platform
import sys
import traceback
from pathlib import Path

from tools.server import gunicorn_settings

from . import (attacks, client_rows, cores, grpc_rows, jobs, recycling, rows, small_requests, tracing_rows, uploads,
               worker_growth)
from .measure import Result, table

def dripping_uploads(bench) -> list:
    return uploads.dripping_uploads(bench.server())


ROWS = [
    rows.engine_vs_seed,
    rows.http_vs_floor,
    rows.small_requests,
    small_requests.small_requests_vs_peer,
    rows.peak_worker_rss,
    rows.parse_vs_loads,
    rows.v2_binary_infer,
    grpc_rows.grpc_vs_v2,
    tracing_rows.tracing_cost,
    rows.serving_small_requests,
    rows.model_scorer,
    client_rows.client_v1_read,
    rows.default_factor_vs_16,
    rows.default_factor_http_vs_floor,
    rows.advice_leads_somewhere_fast,
    rows.engine_vs_seed_default_factor,
    dripping_uploads,
    attacks.idle_flood_row,
    attacks.slowloris_row,
    recycling.metrics_recycling_row,
    worker_growth.worker_memory_growth,
    worker_growth.large_requests_soak,
    cores.lone_request_speedup,
    cores.concurrent_pairs_balance,
    cores.lone_request_cpu,
    cores.four_concurrent_requests,
    jobs.job_overhead,
    jobs.job_scaling,
    jobs.job_size,
    jobs.job_model,
    jobs.result_download,
    jobs.kept_jobs,
    jobs.runner_peak,
    jobs.idle_cluster_cpu,
]


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem_kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal:"))
    return f"{os.cpu_count()} CPUs ({cpu}), {mem_kib / 1024 ** 2:.1f} GiB memory, Python {platform.python_version()}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("rows", nargs="*", help="row functions to run (default: all)")
    names = parser.parse_args(argv).rows
    selected = [row for row in ROWS if not names or row.__name__ in names]
    if names and len(selected) != len(names):
        parser.error(f"rows are: {', '.join(row.__name__ for row in ROWS)}")

    import torch  # after argument parsing: --help stays fast

    settings = gunicorn_settings()
    print(f"date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}", flush=True)
    print(f"machine: {machine()}", flush=True)
    print(f"torch {torch.__version__}; gunicorn: {settings['workers']} workers x "
          f"{settings['torch_threads']} torch threads (in-process rows use the same threads)", flush=True)
    bench = rows.Bench(torch_threads=int(settings["torch_threads"]))
    results = []
    try:
        for row in selected:
            print(f"running {row.__name__} ...", file=sys.stderr, flush=True)
            try:
                found = row(bench)
            except Exception as exc:  # noqa: BLE001 - one broken row must not cost the others' results
                traceback.print_exc()
                found = [Result(row.__name__, "-", "error", "MISS", f"{type(exc).__name__}: {exc}")]
            results.extend(found)
            for result in found:  # as they come: a run cut short still leaves its rows
                print(table([result]).splitlines()[-1], file=sys.stderr, flush=True)
    finally:
        bench.close()
    print()
    print(table(results))
    return 0 if all(r.verdict != "MISS" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
