"""The job routes' domain errors (statuses in app/http/errors.py's table)."""
from ..core.errors import BlockgradError, limit_exceeded

CLUSTER_RETRY_AFTER_S = 5
JOB_RETRY_AFTER_S = 2


def cluster_unavailable(address: str) -> BlockgradError:
    return BlockgradError(
        "cluster_unavailable",
        f"The Dask scheduler at {address} did not answer in time; jobs are unavailable until it does "
        "(synchronous routes are unaffected). Retry after the Retry-After seconds.",
        {"scheduler": address}, retry_after_s=CLUSTER_RETRY_AFTER_S)


def no_cluster() -> BlockgradError:
    return BlockgradError(
        "cluster_unavailable",
        "This server has no Dask cluster: set BLOCKGRAD_DASK_SCHEDULER, or start it with gunicorn -c "
        "gunicorn.conf.py, which starts an embedded one.", {"scheduler": None}, retry_after_s=CLUSTER_RETRY_AFTER_S)


def job_not_found(job_id: str) -> BlockgradError:
    return BlockgradError(
        "job_not_found",
        f"There is no job {job_id}: unknown, forgotten after BLOCKGRAD_JOB_TTL_S or DELETE, or lost with "
        "a restarted scheduler.", {"id": job_id})


def job_not_done(job_id: str, status: str) -> BlockgradError:
    waiting = status in ("queued", "running")
    advice = "retry after the Retry-After seconds" if waiting else "it has no result; GET the job for its error"
    return BlockgradError("job_not_done", f"Job {job_id} is {status}; {advice}.", {"status": status},
                          retry_after_s=JOB_RETRY_AFTER_S if waiting else None)


def too_many_jobs(active: int, allowed: int) -> BlockgradError:
    return BlockgradError(
        "overloaded",
        f"{active} jobs are queued or running, BLOCKGRAD_MAX_JOBS = {allowed}; retry after the Retry-After "
        "seconds.", {"limit": "BLOCKGRAD_MAX_JOBS", "value": active, "allowed": allowed},
        retry_after_s=JOB_RETRY_AFTER_S)


def job_too_many_vectors(n: int, allowed: int) -> BlockgradError:
    return limit_exceeded(f"{n} vectors is over BLOCKGRAD_MAX_JOB_N = {allowed}; send at most {allowed}.",
                          "BLOCKGRAD_MAX_JOB_N", n, allowed)
