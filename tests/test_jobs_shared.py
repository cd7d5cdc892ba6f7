"""Two services on one PostgreSQL database and one Dask cluster, as two pods share them
(issue 29): two real gunicorns (tools/server.py), each with its job runner, on the `cluster`
fixture's scheduler (no runner of its own) and one database. A job is one job whichever service
answers; a job whose service is SIGKILLed as a whole while its tiles are held is resumed by the
other once the lease has passed, and exactly one result is committed."""
import contextlib
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import psutil
import pytest
import requests

from app.jobs import db
from tests.dask_cluster import HeldTiles, cluster_tls_env
from tests.numeric import assert_matches
from tests.postgres import new_database
from tests.oracle import expected, oracle
from tools.server import children, gunicorn_server, wait_until

pytestmark = pytest.mark.slow
WAIT_S = 90  # generous bound of every wait: the machine may be slow and shared
LEASE_S = "2"


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def runner_pid(server) -> int | None:
    """The job runner under the service's supervisor (None once the service is gone)."""
    for supervisor in children(server.pid):
        if " -m app.jobs.supervisor " in cmdline(supervisor):
            for pid in children(supervisor):
                if " -m app.jobs.runner" in cmdline(pid):
                    return pid
    return None


def gone(pid: int) -> bool:
    """Exited (a zombie not yet reaped counts)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture(scope="module")
def database(postgres_server):
    """One database for the module's two services (postgres_url is per test)."""
    with new_database(postgres_server, "shared") as url:
        yield url


@pytest.fixture(scope="module")
def services(cluster, database):
    """(A, B, the store's engine): started together, each with one web worker, both runners
    seen in the store with the cluster's workers."""
    env = {"BLOCKGRAD_DASK_SCHEDULER": cluster.address, "BLOCKGRAD_JOBS_DB": database,
           "BLOCKGRAD_JOB_LEASE_S": LEASE_S, **cluster_tls_env(cluster.address)}  # its TLS, as Dask configuration
    managers = [gunicorn_server(workers=1, env=env) for _ in range(2)]
    engine = db.open_store(database)
    with contextlib.ExitStack() as stack:
        with ThreadPoolExecutor(2) as pool:
            entered = [pool.submit(manager.__enter__) for manager in managers]
        for manager, future in zip(managers, entered):
            if future.exception() is None:
                stack.callback(manager.__exit__, None, None, None)
        a, b = (future.result() for future in entered)

        def both_runners():
            with engine.connect() as conn:
                return conn.execute(db.select(db.func.count()).where(db.runners.c.workers >= 1)).scalar() == 2
        assert wait_until(both_runners, WAIT_S, 0.2), "two runners did not report the cluster's workers"
        yield a, b, engine
        engine.dispose()


def submit(server, vectors: np.ndarray, factor: int) -> str:
    answer = requests.post(server.url + "/v1/jobs", timeout=WAIT_S, json={
        "vectors": vectors.tolist(), "factor": factor, "dtype": "float64", "outputs": ["accumulated", "losses"]})
    assert answer.status_code == 202, answer.text
    return answer.json()["id"]


def routes(server, job_id: str) -> list[requests.Response]:
    """Every route of a job: GET, its result (JSON and .npz), cancel, DELETE."""
    url = f"{server.url}/v1/jobs/{job_id}"
    return [requests.get(url, timeout=WAIT_S), requests.get(url + "/result", timeout=WAIT_S),
            requests.get(url + "/result", headers={"Accept": "application/x-npz"}, timeout=WAIT_S),
            requests.post(url + "/cancel", timeout=WAIT_S), requests.delete(url, timeout=WAIT_S)]


def test_a_job_submitted_on_one_is_read_cancelled_and_deleted_on_the_other(services, cluster, tmp_path):
    a, b, _ = services
    with HeldTiles(cluster.address, tmp_path / "held") as held:  # running, not done, while asked
        job_id = submit(a, np.ones((8, 2)), 4)
        held.wait_started(job_id, timeout_s=WAIT_S)
        seen = requests.get(f"{b.url}/v1/jobs/{job_id}", timeout=WAIT_S)
        assert seen.status_code == 200 and (seen.json()["id"], seen.json()["status"]) == (job_id, "running")
        cancelled = requests.post(f"{b.url}/v1/jobs/{job_id}/cancel", timeout=WAIT_S)
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled", cancelled.text
        assert requests.get(f"{a.url}/v1/jobs/{job_id}", timeout=WAIT_S).json()["status"] == "cancelled"
        assert requests.post(f"{a.url}/v1/jobs/{job_id}/cancel", timeout=WAIT_S).status_code == 200  # idempotent
        assert requests.delete(f"{b.url}/v1/jobs/{job_id}", timeout=WAIT_S).status_code == 204
        for server in (a, b):
            for answer in routes(server, job_id):
                assert answer.status_code == 404 and answer.json()["error"]["code"] == "job_not_found", (
                    answer.request.method, answer.url, answer.text)


def test_a_job_whose_service_died_is_resumed_by_the_other_with_one_result(services, cluster, tmp_path):
    a, b, engine = services
    vectors = np.random.default_rng(29).standard_normal((40, 3))
    with HeldTiles(cluster.address, tmp_path / "held") as held:
        job_id = submit(a, vectors, 4)
        held.wait_started(job_id, timeout_s=WAIT_S)
        row = db.get_job(engine, job_id)
        assert (row["status"], row["attempts"]) == ("running", 1), row
        owner_pid = int(row["owner"].split("-")[-2])  # host-pid-token of the runner that claimed it
        by_runner = {runner_pid(server): server for server in (a, b)}
        assert owner_pid in by_runner, (row["owner"], by_runner)
        owner = by_runner[owner_pid]
        [survivor] = [server for server in (a, b) if server is not owner]
        os.killpg(owner.pid, signal.SIGKILL)  # master and web worker; the supervisor and runner die with it
        assert wait_until(lambda: gone(owner_pid), WAIT_S, 0.2), "the dead service's runner lives on"
        url = f"{survivor.url}/v1/jobs/{job_id}"
        assert wait_until(lambda: requests.get(url, timeout=WAIT_S).json()["attempts"] == 2, WAIT_S, 0.2), \
            requests.get(url, timeout=WAIT_S).json()
        resumed = db.get_job(engine, job_id)
        assert int(resumed["owner"].split("-")[-2]) == runner_pid(survivor)
        held.release()

        def done():
            return requests.get(url, timeout=WAIT_S).json()["status"] not in ("queued", "running")
        assert wait_until(done, WAIT_S, 0.2), requests.get(url, timeout=WAIT_S).json()
    record = requests.get(url, timeout=WAIT_S).json()
    assert (record["status"], record["attempts"]) == ("succeeded", 2), record
    result = requests.get(url + "/result", timeout=WAIT_S).json()
    truth = oracle(vectors, 4, "sum", 5.0)
    assert_matches(result["accumulated"], expected(truth.accumulated, "float64"), "float64", what="accumulated")
    assert_matches(result["losses"], expected(truth.losses, "float64"), "float64",
                   scale=expected(truth.terms, "float64"), what="losses")
    with engine.connect() as conn:  # one set: each output's one chunk (a 40 x 3 and a 4 x 4 are far under 1 MiB)
        stored = sorted(conn.execute(db.select(db.results.c.output, db.results.c.seq).where(
            db.results.c.job_id == job_id)).all())
    assert stored == [("accumulated", 0), ("losses", 0)], stored
    def finished_lines() -> list[str]:  # the runner logs job_finished after its commit: a moment after the status
        return [line for line in survivor.log().splitlines() if '"event": "job_finished"' in line and job_id in line]
    assert wait_until(finished_lines, WAIT_S, 0.2), "no job_finished line"
    finished = finished_lines()
    assert len(finished) == 1 and '"stored": true' in finished[0], finished
