"""Job metrics (prometheus-client, multiprocess): what the last job submission saw on the
scheduler, and counts of this service's job events."""
from prometheus_client import Counter, Gauge

JOBS = Gauge("blockgrad_jobs", "Jobs on the scheduler by status, as of the last POST /v1/jobs.",
             ["status"], multiprocess_mode="livemostrecent")
BLOCKS_DONE = Gauge("blockgrad_job_blocks_done", "Blocks done of the queued and running jobs, as of the last "
                    "POST /v1/jobs.", multiprocess_mode="livemostrecent")
WORKERS = Gauge("blockgrad_cluster_workers", "Dask workers on the scheduler, as of the last POST /v1/jobs.",
                multiprocess_mode="livemostrecent")
EVENTS = Counter("blockgrad_job_events", "Job submissions and cancellations answered by this service.", ["event"])
STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")


def observe_jobs(states) -> None:
    counts = dict.fromkeys(STATUSES, 0)
    blocks = 0
    for state in states:
        status = state.status
        counts[status] += 1
        if status in ("queued", "running"):
            blocks += state.progress["done"]
    for status, count in counts.items():
        JOBS.labels(status).set(count)
    BLOCKS_DONE.set(blocks)


def observe_workers(count: int) -> None:
    WORKERS.set(count)


def observe_event(event: str) -> None:
    EVENTS.labels(event).inc()
