"""The job gauges of /metrics (app/jobs/store.py refresh_metrics and sweep) against a stand-in
scheduler: whatever the scheduler does, the scrape answers; jobs the API no longer serves are
not counted; a down scheduler is not asked again at every scrape; and only the read of the
value files runs under the metrics directory's lock."""
import dataclasses
import logging
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from app import create_app
from app.api import register_front_ends
from app.core.errors import cluster_unavailable
from app.http.app import build_app, finish_app
from app.jobs import store as job_store
from app.jobs.metrics import JOBS, WORKERS, observe_workers
from app.jobs.on_scheduler import cluster_view, snapshots
from app.jobs.settings import JobSettings
from app.jobs.store import JobStore
from app.serving import metrics_archive

TTL_S = 3600.0
ADDRESS = "tcp://127.0.0.1:1"  # never dialled: the tests below stand in for the scheduler


def gauge(metric, **labels) -> float:
    for family in metric.collect():
        for sample in family.samples:
            if sample.labels == labels:
                return sample.value
    raise AssertionError(f"no sample {labels}")


def snapshot(status: str, finished_ago_s: float | None = None) -> dict:
    """One job as the scheduler's `snapshots` returns it: `status` (a terminal one finished
    `finished_ago_s` ago)."""
    now = time.time()
    record = {"created_at": now - (finished_ago_s or 0) - 1, "submitted": True, "cancelled": None,
              "blocks_total": 4, "result_bytes": 8}
    outcome = None
    if status in ("succeeded", "failed"):
        outcome = {"status": status, "finished_at": now - finished_ago_s}
    progress = {"done": 1, "processing": status == "running", "finish": "waiting", "outcome": "waiting"}
    return {"record": record, "outcome": outcome, "progress": progress}


class StandInCluster:
    """`call(client, function, *args)` of app/jobs/client.py answered here: the scheduler's
    functions from `jobs`, the rest (cancel, unpublish, forget) recorded."""

    def __init__(self, jobs: dict[str, dict], workers: int = 2):
        self.jobs, self.workers, self.forgotten = jobs, workers, []
        self._run_on_scheduler, self._get_dataset = "run_on_scheduler", "get_dataset"
        self._cancel, self._unpublish_dataset = "cancel", "unpublish"

    def call(self, client, function, *args, **kwargs):
        assert client is self
        if function == "run_on_scheduler" and args[0] is cluster_view:
            return {"jobs": dict(self.jobs), "workers": self.workers}
        if function == "run_on_scheduler" and args[0] is snapshots:
            return dict(self.jobs)
        if function == "run_on_scheduler":  # forget_records
            self.forgotten.append(args[1])
            self.jobs.pop(args[1], None)
        return None


@pytest.fixture
def stand_in(monkeypatch):
    def install(jobs: dict[str, dict]) -> StandInCluster:
        cluster = StandInCluster(jobs)
        monkeypatch.setattr(job_store, "cluster_client", lambda address: cluster)
        monkeypatch.setattr(job_store, "call", cluster.call)
        return cluster
    return install


def store(address: str = ADDRESS) -> JobStore:
    return JobStore(dataclasses.replace(JobSettings.from_env({}), dask_scheduler=address, job_ttl_s=TTL_S))


def jobs_app(make_store):
    """The app with `make_store(environ)` as its job store (past the settings' own checks)."""
    app, api = build_app({"TESTING": True}, None, make_store)
    register_front_ends(app, api)
    return finish_app(app, api)


def scraped_workers(client) -> float:
    response = client.get("/metrics")
    assert response.status_code == 200, response.get_data(as_text=True)[:500]
    for family in text_string_to_metric_families(response.get_data(as_text=True)):
        for sample in family.samples:
            if sample.name == "blockgrad_cluster_workers":
                return sample.value
    raise AssertionError("no blockgrad_cluster_workers")


def test_a_scrape_answers_with_a_scheduler_address_dask_refuses(caplog):
    """Not an OSError: Dask raises ValueError for an unknown scheme. The scrape still answers 200."""
    observe_workers(2)
    client = jobs_app(lambda environ: store("http://127.0.0.1:1")).test_client()
    with caplog.at_level(logging.WARNING, "blockgrad.jobs"):
        assert scraped_workers(client) == 0
    assert "job_metrics_unread" in caplog.messages


def test_a_scrape_answers_when_the_scheduler_answers_nonsense(stand_in):
    stand_in({"a" * 32: {"record": {}, "outcome": None, "progress": {}}})  # no "submitted", no "done"
    observe_workers(2)
    client = jobs_app(lambda environ: store()).test_client()
    assert scraped_workers(client) == 0


def test_a_bad_scheduler_address_is_refused_at_start_naming_the_variable():
    for address in ("http://dask-scheduler:8786", "tcp://dask-scheduler", "dask-scheduler", "tcp://host:port"):
        with pytest.raises(ValueError, match="BLOCKGRAD_DASK_SCHEDULER"):
            JobSettings.from_env({"BLOCKGRAD_DASK_SCHEDULER": address})
    for address in ("tcp://dask-scheduler:8786", "tls://10.0.0.1:8786", "127.0.0.1:8786", "off"):
        assert JobSettings.from_env({"BLOCKGRAD_DASK_SCHEDULER": address}).dask_scheduler == address
    assert JobSettings.from_env({"BLOCKGRAD_DASK_SCHEDULER": ""}).dask_scheduler is None


def test_after_a_failed_read_scrapes_leave_the_scheduler_alone_for_a_while(monkeypatch):
    dialled = []

    def unreachable(address):
        dialled.append(address)
        raise cluster_unavailable(address)
    monkeypatch.setattr(job_store, "cluster_client", unreachable)
    jobs = store()
    observe_workers(2)
    for _ in range(5):
        jobs.refresh_metrics()
    assert len(dialled) == 1
    assert gauge(WORKERS) == 0
    clock = time.monotonic() + job_store.METRICS_RETRY_S + 1  # the pause is over
    monkeypatch.setattr(job_store.time, "monotonic", lambda: clock)
    jobs.refresh_metrics()
    assert len(dialled) == 2


def test_the_gauges_leave_out_jobs_past_their_ttl(stand_in):
    """The API answers 404 for them (and forgets them at the next GET or POST): not counted."""
    stand_in({"1" * 32: snapshot("succeeded", finished_ago_s=10), "2" * 32: snapshot("succeeded", TTL_S + 10),
              "3" * 32: snapshot("failed", TTL_S + 10), "4" * 32: snapshot("running")})
    store().refresh_metrics()
    counts = {status: gauge(JOBS, status=status) for status in ("succeeded", "failed", "running")}
    assert counts == {"succeeded": 1, "failed": 0, "running": 1}
    assert gauge(WORKERS) == 2


def test_a_sweep_counts_only_the_jobs_it_kept(stand_in):
    cluster = stand_in({"1" * 32: snapshot("succeeded", finished_ago_s=10), "2" * 32: snapshot("succeeded", TTL_S + 10),
                        "4" * 32: snapshot("running")})
    jobs = store()
    assert jobs.sweep(cluster) == 1  # the running one
    assert cluster.forgotten == ["2" * 32]
    assert {status: gauge(JOBS, status=status) for status in ("succeeded", "running")} == {"succeeded": 1,
                                                                                         "running": 1}


def test_only_the_read_of_the_value_files_holds_the_scrape_lock(tmp_path, monkeypatch):
    """The master's fold (hooks.child_exit) waits for the lock: the job gauges' read of the
    scheduler (up to METRICS_READ_S) must run outside it, the files' read inside."""
    from app.core import host

    monkeypatch.setattr(host, "scrape_lock", metrics_archive.scrape_lock(str(tmp_path)))
    folds_possible = {}

    def fold_possible() -> bool:
        with metrics_archive.exclusive(str(tmp_path), 0) as locked:
            return locked

    class Jobs:
        def refresh_metrics(self):
            folds_possible["reading the scheduler"] = fold_possible()

    from app.api import metrics as metrics_route
    exposition = metrics_route.exposition

    def watched_exposition():
        folds_possible["reading the files"] = fold_possible()
        return exposition()
    monkeypatch.setattr(metrics_route, "exposition", watched_exposition)
    monkeypatch.setattr(job_store, "JobStore", lambda settings: Jobs())
    client = create_app({"TESTING": True}).test_client()
    assert client.get("/metrics").status_code == 200
    assert folds_possible == {"reading the scheduler": True, "reading the files": False}
    assert fold_possible()  # released after the scrape
