"""The jobs' settings (docs/jobs.md), read as every layer's are (app/core/settings.py).

Standard library only: gunicorn's master reads them to start the embedded cluster.
"""
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
    max_job_results_bytes: int = 2 * 1024 * 1024 * 1024  # retained results; the oldest finished go first
