"""The job routes' side of the job store (app/jobs/db.py, docs/jobs.md): a job is rows in the
database (record, input, result), read and written here; this process never talks to Dask (the
runner, app/jobs/runner.py, does). The database is opened at the first job route or scrape of
each process, never before gunicorn forks (an engine's connections must not cross a fork)."""
import io
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from hashlib import sha256
from typing import Any

import numpy as np

import app.tracing as tracing

from ..core.admission import output_elements
from ..core.errors import BlockgradError, job_done, job_not_done, job_not_found, no_cluster, store_unavailable
from ..core.request import GradientRequest
from . import db
from .metrics import EVENTS, observe_jobs, observe_workers
from .settings import OFF, JobSettings

log = logging.getLogger("blockgrad.jobs")
ID_PATTERN = re.compile(r"[0-9a-f]{32}")  # 128 random bits
# A /metrics scrape waits at most this long for the store: an unreachable one never hangs it.
METRICS_READ_S = 1.0
# After a read that failed, scrapes read nothing for this long: a down store costs each one nothing.
METRICS_RETRY_S = 5.0
OPEN_RETRY_S = 2.0  # after the store could not be opened, job routes answer 503 at once for this long


def rfc3339(seconds: float | None) -> str | None:
    return None if seconds is None else (
        time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{int(seconds % 1 * 1000):03d}Z")


def public(row: dict) -> dict[str, Any]:
    """The job record of the API, from its row."""
    status, total = row["status"], row["blocks_total"]
    done = total if status == "succeeded" else min(total, row["blocks_done"])
    return {"id": row["id"], "status": status,
            **{key: row[key] for key in ("n", "dim", "factor", "objective", "dtype")},
            "outputs": list(row["outputs"]), "progress": {"blocks_done": done, "blocks_total": total},
            "attempts": row["attempts"], "created_at": rfc3339(row["created_at"]),
            "started_at": rfc3339(row["started_at"]), "finished_at": rfc3339(row["finished_at"]), "error": row["error"]}


class JobStore:
    """The job routes' operations on the store (SQLite or PostgreSQL, JobSettings.database_url)."""

    def __init__(self, settings: JobSettings):
        self.settings = settings
        self._engine, self._pid, self._lock = None, None, threading.Lock()
        self._open_after = 0.0  # time.monotonic() before which a failed open is not tried again
        self.metrics_read_after = 0.0  # time.monotonic() before which a scrape does not read
        self.reading: Future | None = None  # the scrape's read of the store, which may outlive the scrape
        self.reader: ThreadPoolExecutor | None = None
        self.workers = 0  # the cluster's, as the last read of the store found them (0: unread)

    @property
    def engine(self):
        """This process's engine, opened (and migrated) at its first use; 503 cluster_unavailable
        when jobs are off (BLOCKGRAD_DASK_SCHEDULER=off)."""
        if self.settings.dask_scheduler == OFF:
            raise no_cluster()
        with self._lock:
            if self._engine is None or self._pid != os.getpid():
                if time.monotonic() < self._open_after:  # a failed open is not retried by every waiting request
                    raise store_unavailable()
                try:
                    self._engine, self._pid = db.open_store(self.settings.database_url(), "blockgrad-web"), os.getpid()
                except BlockgradError:
                    self._open_after = time.monotonic() + OPEN_RETRY_S
                    raise
            return self._engine

    def cluster_report(self) -> dict:
        """For /readyz, never waiting for the store: its kind, and the cluster's workers as the last
        read of the job runners' heartbeats found them (refresh_metrics' read, started here if none
        is under way); reachable: a runner seen lately reaches a cluster with a worker. Never where."""
        if self.settings.dask_scheduler == OFF:
            return {"store": None, "reachable": False, "workers": 0}
        self.refresh_metrics(wait_s=0)
        url = self.settings.database_url()
        return {"store": url.split(":", 1)[0].split("+")[0], "reachable": self.workers > 0, "workers": self.workers}

    def refresh_metrics(self, wait_s: float = METRICS_READ_S) -> None:
        """The job gauges read from the store now, for a scrape, waiting at most wait_s (0: the
        read goes on alone). A store that cannot be read: 0 workers, the job gauges as last
        read, and no read for METRICS_RETRY_S (a read still running is not started again)."""
        if self.settings.dask_scheduler == OFF or time.monotonic() < self.metrics_read_after:
            return
        if self.reading is None or self.reading.done():
            self.reader = self.reader or ThreadPoolExecutor(1, "job-metrics")
            self.reading = self.reader.submit(self.read_metrics)
        if not wait_s:
            return
        try:
            self.reading.result(timeout=wait_s)
        except Exception as exc:  # noqa: BLE001 - a scrape answers whatever the store does
            if not isinstance(exc, (BlockgradError, TimeoutError)):  # store_unavailable is the expected one
                log.warning("job_metrics_unread", extra={"fields": {"error": repr(exc)}})
            self.metrics_read_after = time.monotonic() + METRICS_RETRY_S
            self.workers = 0
            observe_workers(0)

    def read_metrics(self) -> None:
        try:
            engine = self.engine
            observe_jobs(db.status_counts(engine))
            self.workers = db.cluster_workers(engine, time.time())
        except Exception:
            self.workers = 0  # /readyz, which does not wait for this read, says so too
            raise
        observe_workers(self.workers)

    def row(self, job_id: str) -> dict:
        """The job's row; 404 for an unknown one and for one finished longer than BLOCKGRAD_JOB_TTL_S
        ago (the runner's sweep deletes it)."""
        found = db.get_job(self.engine, job_id) if ID_PATTERN.fullmatch(job_id) else None
        if found is None or (found["finished_at"] is not None
                             and time.time() - found["finished_at"] > self.settings.job_ttl_s):
            raise job_not_found(job_id)
        return found

    def view(self, job_id: str) -> dict[str, Any]:
        return public(self.row(job_id))

    def submit(self, req: GradientRequest, idempotency_key: str | None = None) -> tuple[dict[str, Any], bool]:
        """(the job record, whether it is new): its row and input stored, queued, whatever the
        cluster does. A POST with an Idempotency-Key already used gets that key's job if it sends
        the same request (vectors and fields), else 422 idempotency_key_reused."""
        vectors = np.ascontiguousarray(req.vectors, dtype=req.dtype)  # (N, D), the job's dtype
        buffer = io.BytesIO()
        np.save(buffer, vectors, allow_pickle=False)
        digest = sha256(buffer.getbuffer())  # the request, to tell a retry from a reused Idempotency-Key
        digest.update(repr((req.factor, req.objective, float(req.offset), req.dtype, tuple(req.outputs))).encode())
        row = {"id": secrets.token_hex(16), "n": req.n, "dim": req.dim, "factor": req.factor,
               "objective": req.objective, "offset": float(req.offset), "dtype": req.dtype,
               "outputs": list(req.outputs), "blocks_total": req.factor ** 2,
               "result_bytes": output_elements(req.n, req.dim, req.factor, req.outputs) * vectors.itemsize,
               "idempotency_key": idempotency_key, "request_hash": digest.hexdigest(), "created_at": time.time(),
               "traceparent": tracing.current_traceparent()}
        stored, created = db.insert_job(self.engine, row, buffer.getvalue(), self.settings)
        if created:
            EVENTS.labels("submitted").inc()
            log.info("job_submitted", extra={"fields": {key: row[key] for key in (
                "id", "n", "dim", "factor", "objective", "dtype")}})
        return public(stored), created

    def cancel(self, job_id: str) -> dict[str, Any]:
        """A queued or running job: cancelled (idempotent); a succeeded or failed one: 409 job_done."""
        found = self.row(job_id)
        if found["status"] in db.ACTIVE:
            found = db.cancel_job(self.engine, job_id, time.time())
            if found is None:
                raise job_not_found(job_id)
            if found["status"] == "cancelled":
                EVENTS.labels("cancelled").inc()
                log.info("job_cancelled", extra={"fields": {"job": job_id}})
        if found["status"] != "cancelled":
            raise job_done(job_id, found["status"])
        return public(found)

    def delete(self, job_id: str) -> None:
        """The job forgotten with its input and result (a running one's runner then drops it)."""
        self.row(job_id)
        if not db.delete_job(self.engine, job_id):
            raise job_not_found(job_id)
        log.info("job_deleted", extra={"fields": {"job": job_id}})

    def result(self, job_id: str) -> dict:
        """A succeeded job's row; 409 job_not_done otherwise."""
        found = self.row(job_id)
        if found["status"] != "succeeded":
            raise job_not_done(job_id, found["status"])
        return found

    def chunks(self, row: dict, output: str, rows: int) -> Iterator[np.ndarray]:
        """The output's `rows` rows, chunk by chunk; 404 job_not_found if the job was deleted
        meanwhile (the stream is then cut, never completed wrong)."""
        seen = 0
        for chunk in db.result_chunks(self.engine, row, output):
            seen += len(chunk)
            yield chunk
        if seen != rows:
            raise job_not_found(row["id"])
