"""The job runner (app/jobs/runner.py) against a real local Dask cluster and a real SQLite store,
and the faults issue 29 names, each made at a known point (tiles held at their start, the
runner's before_finish hook) rather than raced: the scheduler SIGKILLed mid-job, the worker
holding a finished outcome SIGKILLed before it is stored, a runner stopped mid-job, a runner
that stalls past its lease while another takes the job over, a graph lost more often than
BLOCKGRAD_JOB_ATTEMPTS allows. Every result is checked against tests/oracle.py's literal loops."""
import os
import signal
import threading
from pathlib import Path

import numpy as np
import pytest

from app.jobs import db, runner as runner_module
from tests.dask_cluster import (HeldTiles, cluster_client, insert_job, running, store_config, stored_result,
                                wait_for_stored, wait_for_workers)
from tests.numeric import assert_matches
from tests.oracle import expected, oracle
from tools.server import children, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
WAIT_S = 90


def engine_of(tmp_path):
    return db.open_store("sqlite:///" + str(tmp_path / "data" / "jobs.sqlite3"))


def job_vectors(seed: int, n: int = 40, dim: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, dim))


def assert_exact(engine, record: dict, vectors: np.ndarray, factor: int, objective: str = "sum") -> None:
    """The stored result against the oracle: losses and the accumulated gradient."""
    assert record["status"] == "succeeded", record
    truth = oracle(vectors, factor, objective, 5.0)
    assert_matches(stored_result(engine, record, "accumulated"), expected(truth.accumulated, "float64"), "float64",
                   what="accumulated")
    assert_matches(stored_result(engine, record, "losses"), expected(truth.losses, "float64"), "float64",
                   scale=expected(truth.terms, "float64"), what="losses")


def dask_pids(cluster, role: str) -> list[int]:
    from tests.dask_cluster import dask_role

    def line(pid):
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            return ""
    return [pid for pid in children(cluster.processes[0].pid) if dask_role(line(pid)) == role]


def test_a_job_the_runner_computes_equals_the_oracle(runner, tmp_path):
    started = runner()
    engine = engine_of(tmp_path)
    vectors = job_vectors(1)
    job_id = insert_job(engine, vectors, 4, "logsumexp")
    record = wait_for_stored(engine, job_id)
    assert_exact(engine, record, vectors, 4, "logsumexp")
    assert (record["attempts"], record["blocks_done"], record["owner"]) == (1, 16, None)
    assert db.load_input(engine, job_id) is None  # the input goes once the result is in
    assert db.cluster_workers(engine, record["finished_at"] + 1) == 2  # the runner's heartbeat row
    assert started.attempts == {}


def test_a_job_survives_its_scheduler_killed_under_it(cluster, runner, tmp_path):
    """The scheduler SIGKILLed while the job's tiles run: the supervisor starts a new one at the
    same address, the runner's futures come back cancelled, the job's second attempt succeeds."""
    runner()
    engine = engine_of(tmp_path)
    vectors = job_vectors(2)
    with HeldTiles(cluster.address, tmp_path / "held") as held:
        job_id = insert_job(engine, vectors, 4)
        held.wait_started(job_id)
        [scheduler] = dask_pids(cluster, "scheduler")
        os.kill(scheduler, signal.SIGKILL)
        held.release()  # tiles of the first attempt still held on a surviving worker go on
        record = wait_for_stored(engine, job_id, WAIT_S)
    assert_exact(engine, record, vectors, 4)
    assert record["attempts"] == 2
    wait_for_workers(cluster.address, 2)


def worker_pids(dask) -> set[int]:
    try:
        return set(dask.run(os.getpid).values())
    except Exception:  # noqa: BLE001 - a worker that has just died
        return set()


def kill_worker(dask, pid: int) -> None:
    """SIGKILL one Dask worker process, then wait until its nanny's new one has joined."""
    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: pid not in (pids := worker_pids(dask)) and len(pids) == 2, WAIT_S, 0.2), \
        f"the killed worker {pid} was not replaced within {WAIT_S} s"


def holder_of(dask, prefix: str) -> tuple[str, str]:
    """(key, the worker's address) of the one key in memory that starts with `prefix`."""
    [(key, workers)] = [(key, workers) for key, workers in dask.who_has().items() if str(key).startswith(prefix)]
    return key, workers[0]


def test_a_worker_lost_with_the_finished_outcome_loses_nothing(cluster, runner, tmp_path):
    """The worker holding the job's computed outcome SIGKILLed before the runner gathered it
    (before_finish holds that moment), then the other one after the result was stored: the job
    succeeds, exact, and its stored result stays."""
    started = runner()
    engine = engine_of(tmp_path)
    dask = cluster_client(cluster.address)
    killed = []

    def kill_holder(job_id: str) -> None:
        if not killed:
            _, holder = holder_of(dask, f"blockgrad-finish-{job_id}-")
            killed.append(dask.run(os.getpid, workers=[holder])[holder])
            os.kill(killed[0], signal.SIGKILL)
            assert wait_until(lambda: holder not in dask.nthreads(), WAIT_S, 0.1)  # the scheduler knows it is gone
    started.before_finish = kill_holder
    vectors = job_vectors(3)
    job_id = insert_job(engine, vectors, 4)
    record = wait_for_stored(engine, job_id)
    assert killed, "the runner never reached before_finish"
    assert_exact(engine, record, vectors, 4)
    assert wait_until(lambda: len(worker_pids(dask)) == 2, WAIT_S, 0.2)
    kill_worker(dask, min(worker_pids(dask)))
    assert_exact(engine, db.get_job(engine, job_id), vectors, 4)


def test_a_runner_stopped_mid_job_hands_it_to_the_next(cluster, runner, tmp_path):
    """SIGTERM's path: the runner releases its job (queued, the attempt not counted); another
    runner then computes it once."""
    first = runner()
    engine = engine_of(tmp_path)
    vectors = job_vectors(4)
    with HeldTiles(cluster.address, tmp_path / "held") as held:
        job_id = insert_job(engine, vectors, 4)
        held.wait_started(job_id)
        assert db.get_job(engine, job_id)["owner"] == first.owner
        first.stop()
        row = db.get_job(engine, job_id)
        assert (row["status"], row["attempts"], row["owner"], row["lease_until"]) == ("queued", 0, None, None)
        held.release()
        runner()
        record = wait_for_stored(engine, job_id)
    assert_exact(engine, record, vectors, 4)
    assert record["attempts"] == 1


def test_a_runner_past_its_lease_is_fenced_out(cluster, runner, tmp_path, monkeypatch):
    """A runner stalls with the job's outcome in hand (before_finish) past its lease: another
    takes the job over and commits it; the stalled one's commit then writes nothing."""
    commits = []
    real_finish = db.finish_job

    def recorded(engine, job_id, owner, attempt, *args):
        stored = real_finish(engine, job_id, owner, attempt, *args)
        commits.append((owner, attempt, stored))
        return stored
    monkeypatch.setattr(db, "finish_job", recorded)
    stalled = runner()
    entered, resume = threading.Event(), threading.Event()
    stalled.before_finish = lambda job_id: entered.set() or resume.wait(WAIT_S)
    engine = engine_of(tmp_path)
    vectors = job_vectors(5)
    job_id = insert_job(engine, vectors, 4)
    assert entered.wait(WAIT_S), "the first runner never reached before_finish"
    other = runner()
    record = wait_for_stored(engine, job_id)
    resume.set()
    assert wait_until(lambda: len(commits) == 2, WAIT_S, 0.1), commits
    assert commits == [(other.owner, 2, True), (stalled.owner, 1, False)]
    assert_exact(engine, record, vectors, 4)
    assert db.get_job(engine, job_id)["attempts"] == 2


def has_task(key: str, dask_scheduler=None) -> bool:
    return key in dask_scheduler.tasks


def test_a_job_whose_graph_is_lost_more_than_allowed_fails(cluster, runner, tmp_path):
    """BLOCKGRAD_JOB_ATTEMPTS = 2, and each attempt's final task is cancelled on the cluster
    (as a lost graph comes back to the runner): failed, job_attempts_exhausted."""
    from distributed import Future

    runner(BLOCKGRAD_JOB_ATTEMPTS="2")
    engine = engine_of(tmp_path)
    dask = cluster_client(cluster.address)
    with HeldTiles(cluster.address, tmp_path / "held"):
        job_id = insert_job(engine, job_vectors(6), 4)
        for attempt in (1, 2):
            key = f"blockgrad-finish-{job_id}-{attempt}"
            assert wait_until(lambda: dask.run_on_scheduler(has_task, key), WAIT_S, 0.1), f"no {key}"
            dask.cancel([Future(key, dask)], force=True)
        record = wait_for_stored(engine, job_id)
    assert (record["status"], record["attempts"]) == ("failed", 2), record
    assert record["error"]["code"] == "job_attempts_exhausted"
    assert db.load_input(engine, job_id) is None
