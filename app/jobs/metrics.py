"""Job metrics (prometheus-client, multiprocess): the jobs and workers as the job store holds
them, read at each scrape (JobStore.refresh_metrics), and counts of this service's job events."""
from prometheus_client import Counter, Gauge

JOBS = Gauge("blockgrad_jobs", "Jobs in the job store by status, read when scraped.",
             ["status"], multiprocess_mode="livemostrecent")
BLOCKS_DONE = Gauge("blockgrad_job_blocks_done", "Blocks done of the queued and running jobs, read when "
                    "scraped.", multiprocess_mode="livemostrecent")
WORKERS = Gauge("blockgrad_cluster_workers", "Dask workers the job runners last saw, read from the store when "
                "scraped (0: it could not be read).", multiprocess_mode="livemostrecent")
EVENTS = Counter("blockgrad_job_events", "Job submissions and cancellations answered by this service.", ["event"])
STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")


def observe_jobs(counts: dict) -> None:
    """`counts`: db.status_counts' answer (a status missing from it has no job)."""
    for status in STATUSES:
        JOBS.labels(status).set(counts.get(status, 0))
    BLOCKS_DONE.set(counts.get("blocks_done", 0))


def observe_workers(count: int) -> None:
    WORKERS.set(count)
