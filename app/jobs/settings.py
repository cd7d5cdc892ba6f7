"""The jobs' settings (docs/jobs.md), read as every layer's are (app/core/settings.py).

Standard library only: gunicorn's master reads them to start the embedded cluster.
"""
import os
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from ..core.settings import FromEnv, available_cores

# Dask's address schemes a scheduler listens on (`host:port` alone means tcp://).
SCHEDULER_SCHEMES = ("tcp", "tls", "ws", "wss", "ucx")
OFF = "off"  # BLOCKGRAD_DASK_SCHEDULER=off: no cluster at all, job routes answer 503


def parse_scheduler(name: str, raw: Any) -> str:
    """A Dask scheduler's address or `off` (unset is the default); anything else raises naming
    the variable here, not as an error at every job route and scrape."""
    address = str(raw).strip()
    if address == OFF:
        return address
    parts = urlsplit(address if "://" in address else f"tcp://{address}")
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in SCHEDULER_SCHEMES or not parts.hostname or port is None or parts.path not in ("", "/"):
        raise ValueError(f"{name} must be {OFF!r} or a scheduler address such as tcp://host:8786 "
                         f"(scheme one of {', '.join(SCHEDULER_SCHEMES)}), got {raw!r}")
    return address


DATABASE_SCHEMES = ("postgresql://", "postgresql+psycopg://")


def parse_database(name: str, raw: Any) -> str:
    url = str(raw).strip()
    if not url.startswith(DATABASE_SCHEMES):
        raise ValueError(f"{name} must be a PostgreSQL URL such as postgresql://user:password@host:5432/blockgrad "
                         "(unset: SQLite under BLOCKGRAD_DATA_DIR)")
    return url


@dataclass(frozen=True)
class JobSettings(FromEnv):
    # An existing Dask scheduler's address; None: gunicorn starts an embedded cluster of
    # dask_workers single-threaded workers on 127.0.0.1 (app/jobs/cluster.py).
    dask_scheduler: str | None = field(default=None, metadata={"parse": parse_scheduler})
    dask_workers: int = field(default_factory=available_cores)
    max_job_n: int = 131072
    max_job_body_bytes: int = 256 * 1024 * 1024  # .npy bodies; N = 131072 x D = 64 float64 is 64 MiB
    max_job_block_elements: int = 16 * 1024 * 1024
    max_jobs: int = 16  # queued + running, all workers and pods sharing the scheduler
    job_ttl_s: float = 3600.0  # how long a finished job and its result are kept
    # One job's result (the outputs it asks for), refused at admission when larger: the runner
    # holds one result at a time on its way into the store (docs/operations.md, "Memory").
    max_job_result_bytes: int = 256 * 1024 * 1024
    # Results kept and reserved (active jobs' at their size): a POST past it waits (503), nothing is evicted.
    max_job_results_bytes: int = 2 * 1024 * 1024 * 1024
    max_job_records: int = 10000  # finished jobs kept; past it the oldest expired go, else a POST waits (503)
    # The job store (app/jobs/db.py): PostgreSQL when jobs_db names one, else SQLite in data_dir,
    # absolute from the start (the runner process runs in the repository, not the caller's directory).
    data_dir: str = field(default_factory=lambda: os.path.abspath("data"),
                          metadata={"parse": lambda _name, raw: os.path.abspath(str(raw))})
    jobs_db: str | None = field(default=None, metadata={"parse": parse_database})
    job_attempts: int = 3  # submissions of one job's graph before it fails job_attempts_exhausted
    job_lease_s: float = 30.0  # a runner that stops renewing its job's lease loses it after this

    def __post_init__(self):
        if self.dask_scheduler not in (None, OFF) and self.jobs_db is None:
            raise ValueError("BLOCKGRAD_DASK_SCHEDULER names an external cluster, which other pods share: their jobs "
                             "must be in one database, not this pod's SQLite file. Set BLOCKGRAD_JOBS_DB to a "
                             "postgresql:// URL, or unset BLOCKGRAD_DASK_SCHEDULER for the embedded cluster.")

    def database_url(self) -> str:
        return self.jobs_db or "sqlite:///" + os.path.join(self.data_dir, "jobs.sqlite3")
