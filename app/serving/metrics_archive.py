"""Dead workers' counters and histograms folded into one archive file per metric type, so
that the multiprocess directory holds a few files per live worker plus a constant, and no
total ever drops.

prometheus-client names a worker's value files <type>_<pid>.db (gauges gauge_<mode>_<pid>.db)
and a scrape adds up every *.db file in the directory, keyed by metric and labels. When a
worker has died, the master adds each of its counter, histogram and summary values into
<type>_archive.db (written as a new file, then renamed over the old one), deletes its files
and drops its live gauges as prometheus-client's mark_process_dead does. Values that only add
up can be folded; gauges of the other modes (min, max, all, ...) cannot and are left, so the
app defines live gauges only.

A scrape that listed the dead worker's file before the fold and read the new archive after it
would count that worker twice (or fail on the vanished file): scrapes hold a shared lock on
LOCK_NAME while they read the files (`scrape_lock`, around the exposition only: nothing
slower, such as the job gauges' read of the scheduler, runs under it), the fold holds it
exclusively.

prometheus-client is imported inside the functions: the master loads this module before
PROMETHEUS_MULTIPROC_DIR is set, and the library picks its multiprocess mode on first import.
"""
import fcntl
import glob
import os
import time
from collections import defaultdict
from contextlib import contextmanager

FOLDED_TYPES = ("counter", "histogram", "summary")  # a histogram's file holds per-bucket counts: they add up
ARCHIVE = "archive"  # in place of a pid: <type>_archive.db, read by every scrape like any worker's file
LOCK_NAME = "archive.lock"
LOCK_POLL_S = 0.005


def fold_into_archive(path: str, kind: str, files: list[str]) -> None:
    """The archive of `kind` plus `files`, key by key, written atomically; then `files` removed."""
    from prometheus_client.mmap_dict import MmapedDict

    archive = os.path.join(path, f"{kind}_{ARCHIVE}.db")
    totals: dict[str, tuple[float, float]] = {}
    for name in ([archive] if os.path.exists(archive) else []) + files:
        for key, value, timestamp, _ in MmapedDict.read_all_values_from_file(name):
            total, latest = totals.get(key, (0.0, 0.0))
            totals[key] = (total + value, max(latest, timestamp))
    staging = archive + ".tmp"  # not *.db: no scrape reads it
    if os.path.exists(staging):
        os.remove(staging)  # left by a fold that failed half-way
    written = MmapedDict(staging)
    try:
        for key, (value, timestamp) in totals.items():
            written.write_value(key, value, timestamp)
    finally:
        written.close()
    os.replace(staging, archive)
    for name in files:
        os.remove(name)


@contextmanager
def exclusive(path: str, wait_s: float):
    """Yields True once no scrape reads the directory (False if scrapes held it all `wait_s`)."""
    with open(os.path.join(path, LOCK_NAME), "a+") as lock:
        end = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= end:
                    yield False
                    return
                time.sleep(LOCK_POLL_S)
        yield True  # closing the file drops its lock


def fold_dead_workers(path: str, live_pids: set[int], wait_s: float = 1.0) -> set[int]:  # the master's wait
    """Fold every dead process's values into the archives; the pids folded. A fold that
    cannot get the lock within `wait_s` is left for the next call: nothing is lost meanwhile."""
    from prometheus_client import multiprocess

    with exclusive(path, wait_s) as locked:
        if not locked:
            return set()
        by_type: dict[str, list[str]] = defaultdict(list)  # value files of processes not in `live_pids`
        dead: set[int] = set()
        for name in glob.glob(os.path.join(path, "*.db")):
            prefix, _, pid = os.path.basename(name)[:-len(".db")].rpartition("_")
            if not pid.isdigit() or int(pid) in live_pids:
                continue
            dead.add(int(pid))
            if prefix in FOLDED_TYPES:
                by_type[prefix].append(name)
        for kind, files in by_type.items():
            fold_into_archive(path, kind, files)
        for pid in dead:
            multiprocess.mark_process_dead(pid, path)  # its live gauges
    return dead


def scrape_lock(path: str):
    """What the app holds while a scrape reads the value files (app/core/host.py): a shared
    lock on the directory, on an open file of its own (threads of one worker scrape independently)."""
    @contextmanager
    def locked():
        with open(os.path.join(path, LOCK_NAME), "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_SH)
            yield  # closing the file drops its lock
    return locked
