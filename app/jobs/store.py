"""Jobs kept with the cluster: a small record per job in the scheduler's metadata, its
graph's final tasks published under the job's name, its end written by the graph itself.
Any gunicorn worker, of any pod sharing the scheduler, sees the same job; a scheduler
that restarts forgets its jobs (they are then 404)."""
import logging
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core.admission import output_elements
from ..core.engine import elements_per_chunk
from ..core.errors import BlockgradError, job_not_done, job_not_found, no_cluster, too_many_jobs
from ..core.job_tasks import JobOutcome, JobSpec, plan_tiles
from ..core.request import GradientRequest
from .client import call, cluster_client, cluster_deadline, cluster_report, current_deadline
from .graph import SCATTER_BYTES_PER_S, dataset_name, submit
from .metrics import EVENTS, observe_jobs, observe_workers
from .on_scheduler import IDEMPOTENCY, JOBS, cluster_view, create_record, forget_records, snapshots, workers_count
from .settings import OFF, JobSettings

log = logging.getLogger("blockgrad.jobs")
ID_PATTERN = re.compile(r"[0-9a-f]{32}")  # 128 random bits
ACTIVE = ("queued", "running")
TERMINAL = ("succeeded", "failed", "cancelled")
RESULT_TIMEOUT_S = 60.0  # fetching a retained result (up to hundreds of MiB) from a worker
RESULT_BYTES_PER_S = 20e6  # fetching a result from a niced worker: the route's deadline grows by its size at this rate
# A record whose graph was never published (the gunicorn worker died between the two) is
# removed this long after its submission's own deadline: clocks of pods may differ a little.
SUBMIT_GRACE_S = 60.0
# A /metrics scrape waits at most this long for the scheduler: an unreachable one never hangs it.
METRICS_READ_S = 1.0
# After a read that failed, scrapes read nothing for this long: a down scheduler costs each one nothing.
METRICS_RETRY_S = 5.0
TASK_FAILED = {"code": "internal_error", "message": "A task of this job failed on the cluster; the cluster's log "
                                                    "has the traceback.", "details": {}}


def rfc3339(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{int(seconds % 1 * 1000):03d}Z"


@dataclass
class JobState:
    """What the scheduler knows of one job, read in one round trip."""
    job_id: str
    record: dict
    outcome: dict | None
    progress: dict

    @property
    def status(self) -> str:
        if self.record.get("cancelled") is not None:
            return "cancelled"
        if self.outcome is not None:
            return self.outcome["status"]
        if not self.record.get("submitted"):
            return "queued"
        if "erred" in (self.progress["finish"], self.progress["outcome"]) or self.progress["finish"] is None:
            return "failed"  # a task raised, or the graph is gone (lost its scattered vectors)
        if self.progress["processing"] or self.progress["done"]:
            return "running"
        return "queued"

    @property
    def finished_at(self) -> float | None:
        if self.record.get("cancelled") is not None:
            return self.record["cancelled"]["at"]
        return (self.outcome or {}).get("finished_at")

    def abandoned(self, now: float) -> bool:
        """Never submitted, and past the bound of the POST that wrote it: that one died."""
        return not self.record.get("submitted") and now > self.record.get("submit_by", float("inf"))

    def expired(self, now: float, ttl_s: float) -> bool:
        """Finished (or cancelled) longer than BLOCKGRAD_JOB_TTL_S ago: then forgotten, 404."""
        return self.status in TERMINAL and now - (self.finished_at or self.record["created_at"]) > ttl_s

    def public(self) -> dict[str, Any]:
        """The job record of the API."""
        status, record = self.status, self.record
        error = (self.outcome or {}).get("error")
        if status == "failed" and error is None:
            error = TASK_FAILED
        total = record["blocks_total"]
        if status == "succeeded":
            done = total
        elif status == "cancelled":  # its tasks are gone: what was done when it was cancelled
            done = record["cancelled"]["blocks_done"]
        else:
            done = min(total, self.progress["done"])
        started = (self.outcome or {}).get("started_at") or record.get("started_at")
        return {"id": self.job_id, "status": status,
                **{key: record[key] for key in ("n", "dim", "factor", "objective", "dtype")},
                "outputs": list(record["outputs"]), "progress": {"blocks_done": done, "blocks_total": total},
                "created_at": rfc3339(record["created_at"]), "started_at": rfc3339(started),
                "finished_at": rfc3339(self.finished_at if status in TERMINAL else None), "error": error}


def job_states(found: dict) -> dict[str, JobState]:
    """on_scheduler.snapshots' answer as JobStates."""
    return {job_id: JobState(job_id, s["record"], s["outcome"], s["progress"]) for job_id, s in found.items()}


class JobStore:
    """The job routes' operations against one scheduler (this process's Client)."""

    def __init__(self, settings: JobSettings):
        self.settings = settings
        self.address = settings.dask_scheduler
        self.metrics_read_after = 0.0  # time.monotonic() before which a scrape does not read

    def client(self):
        if not self.address or self.address == OFF:
            raise no_cluster()
        return cluster_client(self.address)

    def states(self, client, job_ids: list[str] | None) -> dict[str, JobState]:
        return job_states(call(client, client._run_on_scheduler, snapshots, job_ids))

    def cluster_report(self) -> dict:
        """The cluster as this process last saw it, without asking it (/readyz)."""
        return cluster_report(self.address)

    def refresh_metrics(self) -> None:
        """The job gauges read from the scheduler now, for a scrape, within METRICS_READ_S. A
        scheduler that cannot be read (unreachable, a bad address, any error): 0 workers, the
        job gauges as last read, and no read for METRICS_RETRY_S. Nothing is forgotten here."""
        if not self.address or self.address == OFF or time.monotonic() < self.metrics_read_after:
            return  # after a failed read the workers gauge stays 0
        try:
            with cluster_deadline(METRICS_READ_S):
                client = self.client()
                view = call(client, client._run_on_scheduler, cluster_view)
            now = time.time()
            states = [state for state in job_states(view["jobs"]).values() if not state.abandoned(now)
                      and not state.expired(now, self.settings.job_ttl_s)]  # both 404 already
            observe_jobs(states)
            observe_workers(view["workers"])
        except Exception as exc:  # noqa: BLE001 - a scrape answers whatever the cluster does
            if not isinstance(exc, BlockgradError):  # cluster_unavailable is the expected one
                log.warning("job_metrics_unread", extra={"fields": {"error": repr(exc)}})
            self.metrics_read_after = time.monotonic() + METRICS_RETRY_S
            observe_workers(0)

    def state(self, job_id: str) -> tuple[Any, JobState]:
        if not ID_PATTERN.fullmatch(job_id):
            raise job_not_found(job_id)
        client = self.client()
        found = self.live(client, job_id)
        if found is None:
            raise job_not_found(job_id)
        if found.status == "running" and found.record.get("started_at") is None:
            found.record["started_at"] = time.time()  # first seen running: kept for every worker
            call(client, client.scheduler.set_metadata, keys=[JOBS, job_id, "started_at"],
                 value=found.record["started_at"])
            log.info("job_started", extra={"fields": {"job": job_id, "blocks_done": found.progress["done"]}})
        return client, found

    @cluster_deadline()  # a job route's operation: its cluster calls share one deadline (client.py)
    def view(self, job_id: str) -> dict[str, Any]:
        return self.state(job_id)[1].public()

    def live(self, client, job_id: str) -> JobState | None:
        """The job's state; None for an unknown one, and for one abandoned or expired (then
        forgotten here rather than at the next POST's sweep)."""
        found = self.states(client, [job_id]).get(job_id)
        now = time.time()
        if found is not None and found.abandoned(now):
            self.forget_abandoned(client, found)
            return None
        if found is not None and found.expired(now, self.settings.job_ttl_s):
            self.forget(client, job_id)
            return None
        return found

    def known_job(self, client, job_id: str | None) -> dict[str, Any] | None:
        found = self.live(client, job_id) if job_id is not None else None
        return None if found is None else found.public()

    @cluster_deadline()  # a job route's operation: its cluster calls share one deadline (client.py)
    def submit(self, req: GradientRequest, idempotency_key: str | None = None) -> tuple[dict[str, Any], bool]:
        """(the job record, whether it is new). A retried POST with the same
        Idempotency-Key gets the job the first made; so does one sent at the same moment
        (the key is taken with the record, in one step on the scheduler)."""
        client = self.client()
        deadline = current_deadline()
        if idempotency_key:  # a retry costs one call more, and no sweep
            known = self.known_job(client, call(client, client.scheduler.get_metadata,
                                                keys=[IDEMPOTENCY, idempotency_key], default=None))
            if known is not None:
                return known, False
        active = self.sweep(client)
        if active >= self.settings.max_jobs:
            raise too_many_jobs(active, self.settings.max_jobs)
        workers = call(client, client._run_on_scheduler, workers_count)
        observe_workers(workers)
        workers = workers or self.settings.dask_workers
        vectors = np.ascontiguousarray(req.vectors, dtype=req.dtype)  # (N, D), the job's dtype
        spec = JobSpec(req.n, req.dim, req.factor, req.objective, float(req.offset), req.dtype,
                       elements_per_chunk(self.settings.max_job_block_elements, req.objective_fn, req.dim,
                                          vectors.itemsize))
        tiles = plan_tiles(spec.n, spec.dim, spec.factor, workers)
        job_id = secrets.token_hex(16)  # 128 random bits (ID_PATTERN)
        deadline.extend(vectors.nbytes / SCATTER_BYTES_PER_S)  # the scatter's share, by the vectors' size
        now = time.time()
        record = {"n": req.n, "dim": req.dim, "factor": req.factor, "objective": req.objective,
                  "offset": float(req.offset), "dtype": req.dtype, "outputs": list(req.outputs),
                  "created_at": now, "started_at": None, "cancelled": None, "submitted": False,
                  "submit_by": now + deadline.remaining() + SUBMIT_GRACE_S,
                  "blocks_total": req.factor ** 2, "tile_blocks": [tile.blocks for tile in tiles],
                  "result_bytes": output_elements(req.n, req.dim, req.factor, req.outputs) * vectors.itemsize,
                  "idempotency_key": idempotency_key}
        # The record first: the graph's last task writes the outcome only beside an existing one.
        for _ in range(2):  # the key's job may be forgotten between the two calls: its key is then free
            owner = call(client, client._run_on_scheduler, create_record, job_id, record, idempotency_key)
            if owner == job_id:
                break
            known = self.known_job(client, owner)  # the same key's POST, at the same moment, was first
            if known is not None:
                return known, False
        else:
            raise job_not_found(owner)
        try:
            submit(client, job_id, vectors, spec, tiles, req.objective_fn)
            call(client, client.scheduler.set_metadata, keys=[JOBS, job_id, "submitted"], value=True)
        except BaseException:
            self.forget(client, job_id, quiet=True)
            raise
        EVENTS.labels("submitted").inc()
        log.info("job_submitted", extra={"fields": {
            "job": job_id, "n": req.n, "dim": req.dim, "factor": req.factor, "objective": req.objective,
            "dtype": req.dtype, "tiles": len(tiles), "vector_bytes": vectors.nbytes, "workers": workers}})
        record["submitted"] = True
        return JobState(job_id, record, None, {"done": 0, "processing": False, "finish": "waiting",
                                               "outcome": "waiting"}).public(), True

    @cluster_deadline()  # a job route's operation: its cluster calls share one deadline (client.py)
    def result(self, job_id: str, before_fetch: Callable[[dict], None] = lambda record: None
               ) -> tuple[dict[str, Any], JobOutcome]:
        """A succeeded job's record and outcome; `before_fetch(record)` runs before the result
        is fetched (to reserve the memory it takes)."""
        client, found = self.state(job_id)
        if found.status != "succeeded":
            raise job_not_done(job_id, found.status)
        before_fetch(found.record)
        futures = call(client, client._get_dataset, dataset_name(job_id), default=None)
        if futures is None:
            raise job_not_found(job_id)
        current_deadline().extend(found.record["result_bytes"] / RESULT_BYTES_PER_S)
        try:
            [outcome] = call(client, client._gather, [futures[0]], timeout_s=RESULT_TIMEOUT_S)
        except BlockgradError:
            raise
        except Exception:  # noqa: BLE001 - the result was lost with the worker that held it
            log.warning("job_result_lost", extra={"fields": {"job": job_id}})
            self.forget(client, job_id, quiet=True)
            raise job_not_found(job_id) from None
        return found.record, outcome

    @cluster_deadline()  # a job route's operation: its cluster calls share one deadline (client.py)
    def cancel(self, job_id: str) -> dict[str, Any] | None:
        """A queued or running job: cancelled, its record returned. A finished one: forgotten (None)."""
        client, found = self.state(job_id)
        if found.status not in ACTIVE:
            self.forget(client, job_id)
            return None
        found.record["cancelled"] = {"at": time.time(), "blocks_done": min(found.record["blocks_total"],
                                                                             found.progress["done"])}
        call(client, client.scheduler.set_metadata, keys=[JOBS, job_id, "cancelled"], value=found.record["cancelled"])
        self.drop_graph(client, job_id, "job cancelled")
        EVENTS.labels("cancelled").inc()
        log.info("job_cancelled", extra={"fields": {"job": job_id, "was": found.status}})
        return found.public()

    def drop_graph(self, client, job_id: str, reason: str) -> None:
        """The job's tasks cancelled and its published name removed (its record stays)."""
        futures = call(client, client._get_dataset, dataset_name(job_id), default=None) or []
        call(client, client._cancel, futures, force=True, reason=reason)
        call(client, client._unpublish_dataset, dataset_name(job_id))

    def forget(self, client, job_id: str, quiet: bool = False) -> None:
        try:
            self.drop_graph(client, job_id, "job forgotten")
            call(client, client._run_on_scheduler, forget_records, job_id)
        except Exception:
            if not quiet:
                raise

    def forget_abandoned(self, client, found: JobState) -> None:
        log.warning("job_abandoned", extra={"fields": {"job": found.job_id, "created_at": rfc3339(
            found.record["created_at"])}})
        self.forget(client, found.job_id)

    def sweep(self, client) -> int:
        """Forget abandoned submissions, finished jobs past BLOCKGRAD_JOB_TTL_S, then the oldest
        finished results over BLOCKGRAD_MAX_JOB_RESULTS_BYTES; returns the jobs queued or running."""
        now = time.time()
        states = self.states(client, None)
        active, kept = 0, []
        for job_id, found in list(states.items()):
            if found.abandoned(now):  # before its status: never submitted reads as queued
                self.forget_abandoned(client, found)
                del states[job_id]
            elif found.status in ACTIVE:
                active += 1
            elif found.expired(now, self.settings.job_ttl_s):
                self.forget(client, job_id)
                del states[job_id]
            elif found.status == "succeeded":
                kept.append((found.finished_at or found.record["created_at"], found.record["result_bytes"], job_id))
        total = 0
        for _, size, job_id in sorted(kept, reverse=True):  # newest first
            total += size
            if total > self.settings.max_job_results_bytes:
                self.forget(client, job_id)
                del states[job_id]
        observe_jobs(states.values())
        return active

