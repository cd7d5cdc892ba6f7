"""prometheus-client's multiprocess directory: made or emptied before any worker exists,
each worker's value files made whole before it writes them, removed (or emptied) when gunicorn
stops.

Every worker inherits PROMETHEUS_MULTIPROC_DIR and keeps its metric values in files there,
so that /metrics, whichever worker answers it, adds up all workers. Files left from an
earlier run would be added too, hence emptied.
"""
import glob
import os
import shutil
import tempfile
from dataclasses import dataclass

VARIABLE = "PROMETHEUS_MULTIPROC_DIR"  # prometheus-client's name, read by the library itself
STALE_PATTERNS = ("*.db", "*.db.tmp")  # value files and an archive being written


# The value files a worker's metrics write in multiprocess mode, named as prometheus-client
# names them: the metric type, or gauge_<mode> (tests/test_metrics_archive.py checks the app's).
WORKER_KINDS = frozenset({"counter", "histogram", "gauge_livesum", "gauge_liveall", "gauge_livemax",
                          "gauge_livemostrecent"})


@dataclass(frozen=True)
class MetricsDir:
    path: str
    created: bool  # a temporary directory made here: removed whole at exit

    @classmethod
    def prepare(cls, temp_parent: str | None = None) -> "MetricsDir":
        """The directory PROMETHEUS_MULTIPROC_DIR names, or a new temporary one that it then
        names; empty either way. Must run before prometheus-client is first imported: the
        library picks its multiprocess mode then."""
        path = os.environ.get(VARIABLE)
        created = not path
        if created:
            path = tempfile.mkdtemp(prefix="blockgrad-metrics-", dir=temp_parent)
            os.environ[VARIABLE] = path
        os.makedirs(path, exist_ok=True)
        directory = cls(path, created)
        directory.empty()
        return directory

    def empty(self) -> None:
        for pattern in STALE_PATTERNS:
            for stale in glob.glob(os.path.join(self.path, pattern)):
                os.remove(stale)

    def prepare_worker_files(self, pid: int, kinds=WORKER_KINDS) -> None:
        """This worker's value files, sized, before prometheus-client opens them. The library
        creates a file empty and sizes it afterwards, and a scrape reading it in between fails
        (prometheus/client_python#1199); a file that already exists it only opens. Each is
        written under another name and linked into place whole."""
        from prometheus_client.mmap_dict import MmapedDict

        for kind in kinds:
            final = os.path.join(self.path, f"{kind}_{pid}.db")
            staging = final + ".tmp"
            MmapedDict(staging).close()
            try:
                os.link(staging, final)
            except FileExistsError:
                pass  # a dead process's with the same pid, not folded yet: the counts go on from it
            finally:
                os.remove(staging)

    def remove(self) -> None:
        if self.created:
            shutil.rmtree(self.path, ignore_errors=True)
        else:
            self.empty()
