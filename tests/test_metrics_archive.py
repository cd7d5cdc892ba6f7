"""Dead workers' value files folded into the archive (app/serving/metrics_archive.py): the files
are written by real processes through prometheus-client, the totals read back through its
MultiProcessCollector, and compared with the literal sums of what the processes counted."""
import os
import shutil
import subprocess
import sys
import threading

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

from app.serving.metrics_archive import fold_dead_workers, scrape_lock
from app.serving.metrics_dir import WORKER_KINDS, MetricsDir

WORKERS = 6
COPIES = 40
# Worker k counts k + 1 requests of 0.05 s and one of 0.5 s; each holds one request in flight.
WORKER = """
import os, sys
from prometheus_client import Counter, Gauge, Histogram, Summary
k = int(sys.argv[1])
requests = Counter("t_requests", "requests", ["route"])
latency = Histogram("t_latency_seconds", "latency", buckets=(0.1, 1.0))
sizes = Summary("t_size_bytes", "sizes")
in_flight = Gauge("t_in_flight", "in flight", multiprocess_mode="livesum")
for _ in range(k + 1):
    requests.labels("/a").inc()
    latency.observe(0.05)
requests.labels("/b").inc(2)
latency.observe(0.5)
sizes.observe(10 * (k + 1))
in_flight.inc()
print(os.getpid())
"""
REQUESTS_A = sum(k + 1 for k in range(WORKERS))  # 21
EXPECTED = {
    ("t_requests_total", (("route", "/a"),)): REQUESTS_A,
    ("t_requests_total", (("route", "/b"),)): 2 * WORKERS,
    ("t_latency_seconds_bucket", (("le", "0.1"),)): REQUESTS_A,
    ("t_latency_seconds_bucket", (("le", "1.0"),)): REQUESTS_A + WORKERS,
    ("t_latency_seconds_bucket", (("le", "+Inf"),)): REQUESTS_A + WORKERS,
    ("t_latency_seconds_count", ()): REQUESTS_A + WORKERS,
    ("t_size_bytes_count", ()): WORKERS,
    ("t_size_bytes_sum", ()): 10 * REQUESTS_A,
}


@pytest.fixture
def metrics_dir(tmp_path):
    """WORKERS processes' files, each process gone once it has counted: their pids in order."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    pids = [int(subprocess.run([sys.executable, "-c", WORKER, str(k)], env=env, capture_output=True, text=True,
                               timeout=120, check=True).stdout) for k in range(WORKERS)]
    return tmp_path, pids


def totals(path) -> dict:
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(path))
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for m in registry.collect() for s in m.samples}


def counted(path) -> dict:
    found = totals(path)
    return {key: found.get(key) for key in EXPECTED}


def test_folding_keeps_every_total_and_leaves_a_constant_number_of_files(metrics_dir):
    path, pids = metrics_dir
    assert counted(path) == EXPECTED
    assert len(list(path.glob("*.db"))) == 4 * WORKERS  # counter, histogram, summary, live gauge each
    assert totals(path)[("t_in_flight", ())] == WORKERS

    assert fold_dead_workers(str(path), live_pids={pids[0]}) == set(pids[1:])
    assert counted(path) == pytest.approx(EXPECTED)
    names = sorted(p.name for p in path.iterdir() if p.suffix == ".db")
    assert names == sorted([f"counter_{pids[0]}.db", f"histogram_{pids[0]}.db", f"summary_{pids[0]}.db",
                            f"gauge_livesum_{pids[0]}.db",
                            "counter_archive.db", "histogram_archive.db", "summary_archive.db"])
    assert totals(path)[("t_in_flight", ())] == 1  # the dead ones' live gauges are gone

    assert fold_dead_workers(str(path), live_pids=set()) == {pids[0]}  # into the existing archive
    assert counted(path) == pytest.approx(EXPECTED)
    assert sorted(p.name for p in path.iterdir() if p.suffix == ".db") == [
        "counter_archive.db", "histogram_archive.db", "summary_archive.db"]
    assert ("t_in_flight", ()) not in totals(path)
    assert fold_dead_workers(str(path), live_pids=set()) == set()  # nothing left to fold
    assert counted(path) == pytest.approx(EXPECTED)
    assert not list(path.glob("*.tmp"))


@pytest.mark.slow  # 40 folds under a scraping thread (without the lock, every run of it fails)
def test_a_scrape_during_folds_sees_every_total_once(metrics_dir):
    """Scrapes under the shared lock while the master folds workers one by one: each sees the
    dead workers' counts exactly once (never twice, never missing, never a vanished file).
    COPIES more "workers" are copies of worker 0's files, for many folds to interleave with."""
    path, pids = metrics_dir
    copies = [10_000_000 + i for i in range(COPIES)]
    for pid in copies:
        for kind in ("counter", "histogram", "summary", "gauge_livesum"):
            shutil.copyfile(path / f"{kind}_{pids[0]}.db", path / f"{kind}_{pid}.db")
    total = REQUESTS_A + COPIES  # worker 0 counted one request of /a
    seen, failures, done = [], [], threading.Event()

    def scrape():
        for _ in range(100_000):  # bounded; ends when the folds are done
            with scrape_lock(str(path))():
                try:
                    seen.append(totals(path)[("t_requests_total", (("route", "/a"),))])
                except Exception as exc:  # noqa: BLE001 - reported below
                    failures.append(exc)
            if done.is_set():
                return

    reader = threading.Thread(target=scrape)
    reader.start()
    try:
        for k in range(COPIES):
            assert fold_dead_workers(str(path), live_pids=set(pids) | set(copies[k + 1:]), wait_s=60) == {copies[k]}
    finally:
        done.set()
        reader.join(120)
    assert not failures
    assert len(seen) > 1 and set(seen) == {total}
    assert totals(path)[("t_requests_total", (("route", "/a"),))] == total
    assert len(list(path.glob("*.db"))) == 4 * WORKERS + 3


def test_a_fold_waits_for_scrapes_and_gives_up_after_its_bound(metrics_dir):
    path, pids = metrics_dir
    with scrape_lock(str(path))():
        assert fold_dead_workers(str(path), live_pids=set(), wait_s=0.05) == set()  # left for the next one
        assert len(list(path.glob("*.db"))) == 4 * WORKERS
    assert fold_dead_workers(str(path), live_pids=set(), wait_s=0.05) == set(pids)
    assert counted(path) == pytest.approx(EXPECTED)


def test_the_app_defines_live_gauges_only():
    """Gauges of the other modes cannot be folded: a dead worker's would stay for good."""
    from prometheus_client import Gauge

    from app.http import metrics
    from app.jobs import metrics as job_metrics

    gauges = [value for module in (metrics, job_metrics) for value in vars(module).values() if isinstance(value, Gauge)]
    assert gauges and all(gauge._multiprocess_mode.startswith("live") for gauge in gauges)


def test_a_workers_files_are_whole_before_it_writes_them(tmp_path):
    """prometheus-client creates a file empty and sizes it afterwards: a scrape in between fails."""
    directory = MetricsDir(str(tmp_path), created=False)
    directory.prepare_worker_files(4242, {"counter", "gauge_livesum"})
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["counter_4242.db", "gauge_livesum_4242.db"]
    assert all((tmp_path / name).stat().st_size > 0 for name in names)
    assert totals(tmp_path) == {}  # whole and empty: a scrape reads them


def test_an_existing_file_keeps_its_counts(metrics_dir):
    """A new worker with a dead one's pid, not folded yet, counts on from it."""
    path, pids = metrics_dir
    MetricsDir(str(path), created=False).prepare_worker_files(pids[0], {"counter", "histogram", "summary"})
    assert counted(path) == EXPECTED


def value_file_kinds(metrics_module) -> set[str]:
    """The value files the module's metrics write in multiprocess mode, named as
    prometheus-client names them: the metric type, or gauge_<mode> for a gauge."""
    from prometheus_client.metrics import MetricWrapperBase

    return {f"gauge_{metric._multiprocess_mode}" if metric._type == "gauge" else metric._type
            for metric in vars(metrics_module).values() if isinstance(metric, MetricWrapperBase)}


def test_the_workers_files_made_before_fork_are_every_kind_the_app_writes():
    from app.http import metrics
    from app.jobs import metrics as job_metrics
    from app.serving import connection_metrics

    assert set().union(*map(value_file_kinds, (metrics, job_metrics, connection_metrics))) <= WORKER_KINDS


def test_value_file_kinds_are_named_as_prometheus_client_names_them():
    from types import SimpleNamespace

    from prometheus_client import Counter, Gauge, Histogram

    module = SimpleNamespace(a=Counter("k_a", "a", registry=None), b=Histogram("k_b", "b", registry=None),
                             c=Gauge("k_c", "c", multiprocess_mode="livesum", registry=None),
                             d=Gauge("k_d", "d", multiprocess_mode="liveall", registry=None), e=3)
    assert value_file_kinds(module) == {"counter", "histogram", "gauge_livesum", "gauge_liveall"}
