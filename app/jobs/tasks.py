"""The functions a job's graph names, with plain arguments (dicts, tuples).

The Dask scheduler unpickles every task's function and arguments to read the graph: these
wrappers and their arguments import nothing heavy, so the scheduler never loads torch
(it would stall its event loop for seconds); the workers import app.core.job_tasks on
the first task they run.
"""
import json
import logging

from ..core.heap import M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, mallopt
from .on_scheduler import JOBS, OUTCOMES

log = logging.getLogger("blockgrad.jobs")
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024  # the ceiling of glibc's own dynamic threshold (64-bit)
_malloc_restored = False


def worker_log() -> logging.Logger:
    """The job log on a Dask worker, whose logging configures only distributed's loggers: to
    its stderr (the service's, for the embedded cluster)."""
    if not log.handlers:
        log.addHandler(logging.StreamHandler())
        log.setLevel(logging.INFO)
        log.propagate = False
    return log


def restore_malloc_reuse() -> None:
    """Once per worker process. A Dask nanny with distributed's defaults starts its worker with
    MALLOC_TRIM_THRESHOLD_=65536 (the embedded cluster's and deploy/k8s/dask's nannies do
    not: cluster.NANNY_ENVIRON), which also pins glibc's mmap threshold at 128 KiB: every
    tensor of a chunk is then a fresh mmap that the kernel zeroes page by page on first
    touch, and most of a tile's CPU goes to the kernel (docs/jobs.md, "Throughput"). These
    are the thresholds glibc's dynamic rule reaches in a gunicorn worker: a chunk's tensors
    (up to 32 MiB) reuse freed heap memory, and up to twice that is kept rather than
    returned. Not glibc: nothing to do."""
    global _malloc_restored
    if _malloc_restored:
        return
    _malloc_restored = True
    mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    mallopt(M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD_BYTES)


def tile_task(vectors, spec: dict, rows: tuple[int, int], cols: tuple[int, int], program=None):
    """program: a model's bytes (a scattered future, resolved here), None for a built-in."""
    from ..core.job_models import ProgramError, job_objective
    from ..core.job_tasks import JobSpec, Tile, failed_tile, run_tile

    restore_malloc_reuse()
    job, tile = JobSpec(**spec), Tile(0, range(*rows), range(*cols))
    try:
        objective = job_objective(job.objective, job.dim, job.dtype, job.program, program)
    except ProgramError as exc:
        return failed_tile(job, tile, exc.error)
    return run_tile(vectors, job, tile, objective)


def band_task(kind: str, *parts):
    from ..core.job_tasks import add_band

    return add_band(kind, *parts)


def finish_task(spec: dict, *bands):
    from ..core.job_tasks import JobSpec, finish

    return finish(JobSpec(**spec), *bands)


def outcome_task(job_id: str, spec: dict, outcome) -> dict:
    """After the last sum, on a worker: the job's end, into the scheduler's metadata, where
    every gunicorn worker reads it."""
    from distributed import get_client

    summary = {"status": "failed" if outcome.error else "succeeded", "error": outcome.error,
               "started_at": outcome.started_at, "finished_at": outcome.finished_at,
               "bytes_moved": outcome.bytes_moved}
    client = get_client()
    if client.get_metadata([JOBS, job_id], None) is None:  # cancelled and forgotten meanwhile
        return summary
    client.set_metadata([OUTCOMES, job_id], summary)
    seconds = max(1e-9, outcome.finished_at - outcome.started_at)
    worker_log().info(json.dumps({"event": "job_finished", "job": job_id, "status": summary["status"],
                         "duration_s": round(seconds, 3), "pairs_per_s": round(spec["n"] ** 2 / seconds),
                         "bytes_moved": outcome.bytes_moved, "error": (outcome.error or {}).get("code")}))
    return summary
