"""Job metrics (prometheus-client, multiprocess): the jobs and workers on the scheduler, read
at each scrape (JobStore.refresh_metrics) and at each job submission, and counts of this
service's job events."""
from prometheus_client import Counter, Gauge

JOBS = Gauge("blockgrad_jobs", "Jobs on the scheduler by status, read when scraped.",
             ["status"], multiprocess_mode="livemostrecent")
BLOCKS_DONE = Gauge("blockgrad_job_blocks_done", "Blocks done of the queued and running jobs, read when "
                    "scraped.", multiprocess_mode="livemostrecent")
WORKERS = Gauge("blockgrad_cluster_workers", "Dask workers on the scheduler, read when scraped (0: it did "
                "not answer).", multiprocess_mode="livemostrecent")
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

