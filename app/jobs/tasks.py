"""The functions a job's graph names, with plain arguments (dicts, tuples).

The Dask scheduler unpickles every task's function and arguments to read the graph: these
wrappers and their arguments import nothing heavy, so the scheduler never loads torch
(it would stall its event loop for seconds); the workers import app.core.job_tasks on
the first task they run.
"""
from contextlib import nullcontext

from ..core.heap import M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, mallopt

MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024  # the ceiling of glibc's own dynamic threshold (64-bit)
_malloc_restored = False


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
    with traced(job.traceparent, "tile", {"blockgrad.rows": rows, "blockgrad.cols": cols}):
        try:
            objective = job_objective(job.objective, job.dim, job.dtype, job.program, program)
        except ProgramError as exc:
            return failed_tile(job, tile, exc.error)
        return run_tile(vectors, job, tile, objective)


def traced(traceparent: str | None, name: str, attributes: dict):
    """A span of the job's trace (the POST's traceparent) while a task runs on this worker;
    tracing set up at the worker's first traced task, from the environment it inherited."""
    import app.tracing as tracing

    if traceparent is None or not tracing.configure():
        return nullcontext()
    return tracing.TRACER.start_as_current_span(name, tracing.PROPAGATOR.extract({"traceparent": traceparent}),
                                                attributes=attributes)


def band_task(traceparent: str | None, kind: str, *parts):
    from ..core.job_tasks import add_band

    with traced(traceparent, "band", {"blockgrad.kind": kind, "blockgrad.parts": len(parts)}):
        return add_band(kind, *parts)


def finish_task(spec: dict, *bands):
    from ..core.job_tasks import JobSpec, finish

    with traced(spec["traceparent"], "finish", {"blockgrad.parts": len(bands)}):
        return finish(JobSpec(**spec), *bands)
