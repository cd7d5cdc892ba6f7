"""The job gauges of /metrics (app/jobs/store.py refresh_metrics), read from the job store at
each scrape: the jobs by status and the blocks done as the store holds them, the workers the
runners last reported; whatever the store does the scrape answers, a store that does not
answer is not asked again at every scrape, and only the read of the value files runs under
the metrics directory's lock."""
import threading
import time

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app import create_app
from app.core.errors import store_unavailable
from app.jobs import db
from app.jobs import store as job_store
from app.jobs.metrics import WORKERS, observe_jobs, observe_workers
from app.jobs.settings import JobSettings
from app.serving import metrics_archive
from tests.events import HANG_S, answered

OWNER = "test-runner"


@pytest.fixture
def client(tmp_path):
    return create_app({"TESTING": True, "BLOCKGRAD_DATA_DIR": str(tmp_path)}).test_client()


def scraped(client) -> dict[str, float]:
    """/metrics' job gauges: status -> blockgrad_jobs, "blocks_done" and "workers"."""
    response = client.get("/metrics")
    assert response.status_code == 200, response.get_data(as_text=True)[:500]
    found = {}
    for family in text_string_to_metric_families(response.get_data(as_text=True)):
        for sample in family.samples:
            if sample.name == "blockgrad_jobs":
                found[sample.labels["status"]] = sample.value
            elif sample.name == "blockgrad_job_blocks_done":
                found["blocks_done"] = sample.value
            elif sample.name == "blockgrad_cluster_workers":
                found["workers"] = sample.value
    return found


def post(client) -> str:
    response = client.post("/v1/jobs", json={"vectors": [[1.0], [2.0], [3.0], [4.0]], "factor": 2})
    assert response.status_code == 202, response.get_json()
    return response.get_json()["id"]


def test_the_gauges_count_what_the_store_holds_when_scraped(client, tmp_path):
    """Jobs moved by the store alone (as the runner moves them) after the last POST: each scrape
    counts them then."""
    engine = db.open_store(f"sqlite:///{tmp_path}/jobs.sqlite3")
    ids = [post(client) for _ in range(5)]
    assert scraped(client) | {"workers": 0} == {"queued": 5, "running": 0, "succeeded": 0, "failed": 0,
                                                 "cancelled": 0, "blocks_done": 0, "workers": 0}
    now = time.time()
    attempts = {job_id: db.claim(engine, job_id, OWNER, now, 30.0, 3) for job_id in ids[:4]}
    db.renew(engine, ids[0], OWNER, attempts[ids[0]], now, 30.0, 3)
    db.renew(engine, ids[1], OWNER, attempts[ids[1]], now, 30.0, 1)
    arrays = {"accumulated": np.ones((4, 1), np.float32), "losses": np.ones((2, 2), np.float32)}
    db.finish_job(engine, ids[2], OWNER, attempts[ids[2]], now, arrays, None)
    db.finish_job(engine, ids[3], OWNER, attempts[ids[3]], now, None, {"code": "internal_error", "message": "x",
                                                                        "details": {}})
    db.cancel_job(engine, ids[4], now)
    db.beat(engine, "runner-a", "tcp://127.0.0.1:1", 3, now)
    assert scraped(client) == {"queued": 0, "running": 2, "succeeded": 1, "failed": 1, "cancelled": 1,
                               "blocks_done": 4, "workers": 3}
    assert client.delete(f"/v1/jobs/{ids[2]}").status_code == 204
    assert scraped(client)["succeeded"] == 0



def test_a_scrape_does_not_wait_for_a_store_that_does_not_answer(client, monkeypatch):
    """The store's read held until released (an unanswering database, at a known point): the
    scrape answers meanwhile, the job gauges as last read, 0 workers; the next scrapes within
    METRICS_RETRY_S start no read; the held read, released, then updates the gauges."""
    release, reads = threading.Event(), []

    def held_counts(engine):
        reads.append(engine)
        assert release.wait(HANG_S)
        return {"queued": 7}
    monkeypatch.setattr(db, "status_counts", held_counts)
    observe_jobs({"queued": 2})
    observe_workers(2)
    first = answered(lambda: scraped(client))
    assert (first["queued"], first["workers"]) == (2, 0) and len(reads) == 1
    for _ in range(3):
        answered(lambda: scraped(client))
    assert len(reads) == 1
    release.set()
    deadline = time.monotonic() + HANG_S
    while scraped(client)["queued"] != 7:
        assert time.monotonic() < deadline, "the released read never updated the gauges"
        time.sleep(0.1)


def test_a_store_that_fails_is_asked_again_only_after_the_pause(monkeypatch, tmp_path):
    dialled = []

    def unreachable(url, application):
        dialled.append(url)
        raise store_unavailable()
    monkeypatch.setattr(db, "open_store", unreachable)
    jobs = job_store.JobStore(JobSettings.from_env({"BLOCKGRAD_DATA_DIR": str(tmp_path)}))
    observe_workers(2)
    for _ in range(5):
        jobs.refresh_metrics()
    assert len(dialled) == 1
    assert [sample.value for sample in WORKERS.collect()[0].samples] == [0]
    clock = time.monotonic() + job_store.METRICS_RETRY_S + 1  # the pause is over
    monkeypatch.setattr(job_store.time, "monotonic", lambda: clock)
    jobs.refresh_metrics()
    assert len(dialled) == 2


def test_without_jobs_a_scrape_reads_no_store(tmp_path):
    client = create_app({"TESTING": True, "BLOCKGRAD_DASK_SCHEDULER": "off",
                         "BLOCKGRAD_DATA_DIR": str(tmp_path)}).test_client()
    assert client.get("/metrics").status_code == 200
    assert not list(tmp_path.iterdir())


def test_bad_job_settings_are_refused_at_start_naming_the_variable():
    for address in ("http://dask-scheduler:8786", "tcp://dask-scheduler", "dask-scheduler", "tcp://host:port"):
        with pytest.raises(ValueError, match="BLOCKGRAD_DASK_SCHEDULER"):
            JobSettings.from_env({"BLOCKGRAD_DASK_SCHEDULER": address, "BLOCKGRAD_JOBS_DB": "postgresql://x/y"})
    for address in ("tcp://dask-scheduler:8786", "tls://10.0.0.1:8786", "127.0.0.1:8786"):
        assert JobSettings.from_env({"BLOCKGRAD_DASK_SCHEDULER": address,
                                     "BLOCKGRAD_JOBS_DB": "postgresql://x/y"}).dask_scheduler == address
    assert JobSettings.from_env({"BLOCKGRAD_DASK_SCHEDULER": ""}).dask_scheduler is None
    with pytest.raises(ValueError, match="BLOCKGRAD_DASK_SCHEDULER.*BLOCKGRAD_JOBS_DB"):  # SQLite: embedded only
        JobSettings.from_env({"BLOCKGRAD_DASK_SCHEDULER": "tcp://dask-scheduler:8786"})


def test_only_the_read_of_the_value_files_holds_the_scrape_lock(tmp_path, monkeypatch):
    """The master's fold (hooks.child_exit) waits for the lock: the job gauges' read of the
    store (up to METRICS_READ_S) must run outside it, the files' read inside."""
    from app.core import host

    monkeypatch.setattr(host, "scrape_lock", metrics_archive.scrape_lock(str(tmp_path)))
    folds_possible = {}

    def fold_possible() -> bool:
        with metrics_archive.exclusive(str(tmp_path), 0) as locked:
            return locked

    class Jobs:
        def refresh_metrics(self):
            folds_possible["reading the store"] = fold_possible()

    from app.api import metrics as metrics_route
    exposition = metrics_route.exposition

    def watched_exposition():
        folds_possible["reading the files"] = fold_possible()
        return exposition()
    monkeypatch.setattr(metrics_route, "exposition", watched_exposition)
    monkeypatch.setattr(job_store, "JobStore", lambda settings: Jobs())
    client = create_app({"TESTING": True}).test_client()
    assert client.get("/metrics").status_code == 200
    assert folds_possible == {"reading the store": True, "reading the files": False}
    assert fold_possible()  # released after the scrape
