"""`python -m app.jobs.runner [SCHEDULER]`: the service's job runner, the one process that talks
to Dask (the supervisor keeps it up; tests run the same Runner as a thread).

It claims the store's queued jobs, and those whose runner stopped renewing its lease,
submits each as a task graph (graph.py), renews the lease with the blocks done, and writes
the result into the store itself: the database stays in the service, the cluster computes
only, and the commit is fenced on (owner, attempt) in the result's own transaction, so a
runner that lost the job writes nothing. A graph Dask lost (a scheduler restart, every copy
of its data gone) is submitted again as a new attempt, at most BLOCKGRAD_JOB_ATTEMPTS times.
While the cluster is unreachable jobs stay queued.
"""
import json
import logging
import os
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import CancelledError
from contextlib import suppress
from dataclasses import dataclass, field

import numpy as np

from ..core.engine import elements_per_chunk
from ..core.errors import BlockgradError, job_failed
from ..core.job_tasks import JobSpec, plan_tiles
from ..core.objectives import Objective
from . import db
from .graph import Graph, submit
from .settings import JobSettings

log = logging.getLogger("blockgrad.jobs")
POLL_S = 0.2  # new jobs are seen this often; a graph that ends wakes the loop at once
SWEEP_S = 10.0
CONNECT_TIMEOUT_S = 10.0  # also how long a Client tries to reconnect to a restarted scheduler
SUBMIT_TIMEOUT_S = 10.0  # a scatter's bound, plus the vectors' size at TRANSFER_BYTES_PER_S
GATHER_TIMEOUT_S = 30.0
TRANSFER_BYTES_PER_S = 20e6
# CommClosedError is an OSError; a scatter cut short by a scheduler restart is cancelled
DASK_ERRORS = (OSError, TimeoutError, ValueError, CancelledError)
CLUSTER_RETRY_S = 5.0  # after a submit the cluster refused, nothing is claimed for this long
TASK_FAILED = job_failed("A task of this job failed on the cluster; the cluster's log has the traceback.").as_dict()
BROKEN = job_failed("The service could not run this job; its log (job_broken) has the traceback.").as_dict()


def event(name: str, **fields) -> None:
    log.info(json.dumps({"event": name, **fields}))


@dataclass
class Attempt:
    """One owned job's attempt: its graph (None until submitted), the blocks of its finished tiles."""
    job_id: str
    number: int
    graph: Graph | None = None
    result_bytes: int = 0
    outputs: list = field(default_factory=list)
    blocks_done: int = 0


class Runner:
    def __init__(self, settings: JobSettings, objectives: Mapping[str, Objective], engine, address: str | None = None):
        self.settings, self.objectives, self.engine = settings, objectives, engine
        self.address = address or settings.dask_scheduler
        self.owner = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self.client = None
        self.attempts: dict[str, Attempt] = {}
        self.outage: str | None = None  # what is down, logged once until it is back
        self.next_beat = self.next_sweep = self.claim_after = self.replace_at = 0.0
        self.workers = 0  # Dask workers seen at the last step
        # Tests: called with the job's id once its outcome is computed, before it is gathered and stored.
        self.before_finish: Callable[[str], None] | None = None
        self.wake = threading.Event()  # set when a graph ends, or to stop

    def run(self, stop_event: threading.Event) -> None:
        try:
            while not stop_event.is_set():
                try:
                    self.step(time.time())
                except BlockgradError:  # store_unavailable: the same work next time
                    self.down("store", "the job store did not answer")
                except Exception:  # noqa: BLE001 - a bug must not stop every job: logged, the next step runs
                    log.exception(json.dumps({"event": "runner_step_failed"}))
                self.wake.wait(POLL_S)
                self.wake.clear()
        finally:
            self.close()

    def down(self, what: str, why: str) -> None:
        if self.outage != what:
            log.warning(json.dumps({"event": "jobs_waiting", "on": what, "why": why}))
        self.outage = what

    def connected(self):
        """This runner's Client, connected now if it has none, or in place of one stuck
        reconnecting; None while the cluster is down."""
        if self.client is not None and self.client.status in ("running", "connecting"):
            if self.client.status == "running":
                self.replace_at = 0.0  # 0: not seen reconnecting
                return self.client
            self.replace_at = self.replace_at or time.time() + 2 * CONNECT_TIMEOUT_S
            if time.time() < self.replace_at:
                return None
            # Twice distributed's own reconnect deadline: an error other than OSError (tornado's
            # "IOStream is not idle") ended its reconnect and left it connecting for ever, and its
            # close fails the same way. Every running graph is submitted again on a new Client.
            event("dask_client_replaced", why="still reconnecting past its deadline")
            for attempt in [a for a in self.attempts.values() if a.graph is not None]:
                self.again(attempt, "dask client replaced")
            with suppress(Exception):
                self.client.close(timeout=CONNECT_TIMEOUT_S)
            self.replace_at = 0.0
        from distributed import Client, Security  # here: importing the module loads no Dask

        if self.address.startswith("tls://") and Security().get_connection_args("client")["ssl_context"] is None:
            # distributed would raise TypeError, then fail every later Client in this process
            self.down("cluster", f"{self.address} needs Dask's TLS configuration (docs/operations.md, Dask TLS)")
            return None
        try:  # direct: data moves between this process and the workers, never through the scheduler
            self.client = Client(self.address, timeout=CONNECT_TIMEOUT_S, set_as_default=False, name="blockgrad-runner",
                                 direct_to_workers=True)
        except DASK_ERRORS as exc:
            self.down("cluster", f"{self.address}: {exc}")
            return None
        return self.client

    def step(self, now: float) -> None:
        settings = self.settings
        if now >= self.next_sweep:
            db.sweep(self.engine, now, settings.job_ttl_s)
            self.next_sweep = now + SWEEP_S
        if now >= self.next_beat:  # before any cluster call: a slow cluster never costs a lease
            for attempt in list(self.attempts.values()):
                if not db.renew(self.engine, attempt.job_id, self.owner, attempt.number, now, settings.job_lease_s,
                                attempt.blocks_done):  # cancelled, deleted, or taken over
                    self.drop(attempt)
            db.beat(self.engine, self.owner, self.address, self.workers, now)
            self.next_beat = now + settings.job_lease_s / 5
        client = self.connected()
        try:
            workers = len(client.nthreads()) if client is not None else 0
        except DASK_ERRORS as exc:
            workers, client = 0, None
            self.down("cluster", str(exc))
        if workers != self.workers:  # the heartbeat row follows the cluster at once (/metrics reads it)
            db.beat(self.engine, self.owner, self.address, workers, now)
        self.workers = workers
        if client is None:
            return
        for attempt in list(self.attempts.values()):
            if attempt.graph is not None:
                self.guarded(self.check, attempt)
        if not self.workers:  # a scatter would wait for one: nothing is claimed until a worker has joined
            self.down("workers", f"no Dask worker has joined {self.address} yet")
            return
        if self.outage is not None:
            event("jobs_resumed", after=self.outage)
            self.outage = None
        for job_id in db.claimable(self.engine, now, settings.max_jobs) if now >= self.claim_after else ():
            number = db.claim(self.engine, job_id, self.owner, now, settings.job_lease_s, settings.job_attempts)
            if number is not None:
                self.attempts[job_id] = Attempt(job_id, number)
        for attempt in list(self.attempts.values()):
            if attempt.graph is None:
                self.guarded(self.launch, attempt, client)

    def guarded(self, work, attempt: Attempt, *args) -> None:
        """One job's step; an error that is neither the store's nor the cluster's fails that job
        alone (a job that breaks the runner every time must not hold it forever)."""
        try:
            work(attempt, *args)
        except BlockgradError:
            raise  # the store did not answer: the whole step waits
        except Exception:  # noqa: BLE001 - logged with its traceback, the job failed
            log.exception(json.dumps({"event": "job_broken", "job": attempt.job_id}))
            self.finish(attempt, None, BROKEN)

    def launch(self, attempt: Attempt, client) -> None:
        """Submit the attempt's graph, or hand the job back if the cluster fails."""
        job_id, number = attempt.job_id, attempt.number
        record = db.get_job(self.engine, job_id)
        if record is None or record["status"] != "running":
            self.drop(attempt)
            return  # cancelled or deleted since
        vectors = db.load_input(self.engine, job_id)
        if vectors is None:
            raise LookupError(f"job {job_id} is running without its input")
        objective = self.objectives.get(record["objective"])
        if objective is None:  # a model this service no longer serves
            self.finish(attempt, None, job_failed(f"The objective {record['objective']!r} is not served by this "
                                                  "service any more.", objective=record["objective"]).as_dict())
            return
        spec = JobSpec(record["n"], record["dim"], record["factor"], record["objective"], record["offset"],
                       record["dtype"], elements_per_chunk(self.settings.max_job_block_elements, objective,
                                                           record["dim"], vectors.itemsize), tuple(record["outputs"]),
                       traceparent=record.get("traceparent"))
        tiles = plan_tiles(spec.n, spec.dim, spec.factor, self.workers or 1)
        try:
            graph = submit(client, f"{job_id}-{number}", vectors, spec, tiles, objective,
                           SUBMIT_TIMEOUT_S + vectors.nbytes / TRANSFER_BYTES_PER_S)
        except ValueError as exc:  # the cluster refused the graph: an attempt spent (no worker: a TimeoutError, below)
            self.again(attempt, f"submit failed: {exc}")
            return
        except DASK_ERRORS as exc:  # the cluster went away: the job waits, no attempt spent
            self.drop(attempt)
            db.release(self.engine, job_id, self.owner, number)
            self.claim_after = time.time() + CLUSTER_RETRY_S
            self.down("cluster", f"submitting job {job_id}: {exc}")
            return
        attempt.graph, attempt.result_bytes, attempt.outputs = graph, record["result_bytes"], record["outputs"]
        for future, _ in list(graph.tiles.values()):
            future.add_done_callback(lambda f: self.tile_done(attempt, f))
        graph.final.add_done_callback(lambda f: self.wake.set())
        event("job_started", job=job_id, attempt=number, tiles=len(tiles), workers=self.workers,
              vector_bytes=vectors.nbytes)

    @staticmethod
    def tile_done(attempt: Attempt, future) -> None:
        """On Dask's one callback thread. The reference dropped: a finished tile's data then
        lives only as long as the sums that need it."""
        _, blocks = attempt.graph.tiles.pop(future.key, (None, 0))
        if future.status == "finished":
            attempt.blocks_done += blocks

    def check(self, attempt: Attempt) -> None:
        status = (final := attempt.graph.final).status  # read once: a callback may change it
        if status in ("pending", "lost"):  # lost: Dask computes it again from the held vectors
            return
        if status == "error":
            self.finish(attempt, None, TASK_FAILED)
        elif status == "cancelled":  # the scheduler restarted, or the data it needed are gone
            self.again(attempt, status)
        else:
            if self.before_finish is not None:
                self.before_finish(attempt.job_id)
            try:
                outcome = final.result(timeout=GATHER_TIMEOUT_S + attempt.result_bytes / TRANSFER_BYTES_PER_S)
            except Exception as exc:  # noqa: BLE001 - lost with its worker, or the scheduler: compute it again
                self.again(attempt, f"gather failed: {exc!r}")
                return
            arrays = None if outcome.error else {name: getattr(outcome, name) for name in attempt.outputs}
            self.finish(attempt, arrays, outcome.error, outcome)

    def finish(self, attempt: Attempt, arrays: dict[str, np.ndarray] | None, error: dict | None,
               outcome=None) -> None:
        self.drop(attempt)
        stored = db.finish_job(self.engine, attempt.job_id, self.owner, attempt.number, time.time(), arrays, error)
        seconds = None if outcome is None else round(outcome.finished_at - outcome.started_at, 3)
        event("job_finished", job=attempt.job_id, attempt=attempt.number, stored=stored,
              status="failed" if error else "succeeded", error=(error or {}).get("code"), duration_s=seconds,
              bytes_moved=None if outcome is None else outcome.bytes_moved)

    def again(self, attempt: Attempt, why: str) -> None:
        """The attempt's graph is lost: the job's next attempt, submitted at the next step, if it has one left."""
        self.drop(attempt)
        event("job_lost", job=attempt.job_id, attempt=attempt.number, why=why)
        number = db.claim(self.engine, attempt.job_id, self.owner, time.time(), self.settings.job_lease_s,
                          self.settings.job_attempts, held=attempt.number)
        if number is not None:
            self.attempts[attempt.job_id] = Attempt(attempt.job_id, number)

    def drop(self, attempt: Attempt) -> None:
        """Forget the attempt and cancel what is left of its graph on the cluster."""
        self.attempts.pop(attempt.job_id, None)
        if attempt.graph is not None and self.client is not None and self.client.status == "running":
            with suppress(*DASK_ERRORS):
                self.client.cancel([attempt.graph.final, *(f for f, _ in list(attempt.graph.tiles.values()))],
                                   force=True)

    def close(self) -> None:
        """Stop: hand every owned job back (queued, the attempt not counted), close the Client."""
        for attempt in list(self.attempts.values()):
            self.drop(attempt)
            db.release(self.engine, attempt.job_id, self.owner, attempt.number)
        if self.client is not None:
            with suppress(Exception):  # a Client stuck reconnecting fails to close (connected())
                self.client.close(timeout=CONNECT_TIMEOUT_S)


def main(argv: list[str]) -> None:
    from ..core.objectives import served_objectives
    from ..core.settings import Settings

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    settings = JobSettings.from_env()
    store = db.open_store(settings.database_url(), "blockgrad-runner")
    runner = Runner(settings, served_objectives(Settings.from_env()), store, argv[0] if argv else None)
    stopping = threading.Event()
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, lambda *_: (stopping.set(), runner.wake.set()))
    runner.run(stopping)


if __name__ == "__main__":
    main(sys.argv[1:])
