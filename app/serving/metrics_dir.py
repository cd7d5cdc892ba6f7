"""prometheus-client's multiprocess directory: made or emptied before any worker exists,
removed (or emptied) when gunicorn stops.

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

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def empty(self) -> None:
        for pattern in STALE_PATTERNS:
            for stale in glob.glob(os.path.join(self.path, pattern)):
                os.remove(stale)

    def remove(self) -> None:
        if self.created:
            shutil.rmtree(self.path, ignore_errors=True)
        else:
            self.empty()
