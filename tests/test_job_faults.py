"""The job runner (app/jobs/runner.py) against a real local Dask cluster and a real SQLite store,
and the faults issue 29 names, each made at a known point (tiles held at their start, the
runner's before_finish hook) rather than raced: the scheduler SIGKILLed mid-job, the worker
holding a finished outcome SIGKILLed before it is stored, a runner stopped mid-job, a runner
that stalls past its lease while another takes the job over, a graph lost more often than
BLOCKGRAD_JOB_ATTEMPTS allows. Every result is checked against tests/oracle.py's literal loops."""
import os
import signal
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
