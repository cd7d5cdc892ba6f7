"""Settings: one frozen object, read once from environment variables with defaults.

Standard library only, so that gunicorn.conf.py can import it without torch.
The limits are sized so that a 2-core, 24 GiB machine serves every request it
accepts (README, "Limits").
"""
import math
import os
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any
from urllib.parse import urlsplit


def parse_int(name: str, raw: Any, default: int) -> int:
    if raw is None or (isinstance(raw, str) and raw.strip() == ""):
        return default
    try:
        value = int(raw) if not isinstance(raw, bool) else None
    except ValueError:
        value = None
    if value is None:
        raise ValueError(f"{name} must be an integer, got {raw!r}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    return value


def parse_float(name: str, raw: Any, default: float) -> float:
    if raw is None or (isinstance(raw, str) and raw.strip() == ""):
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {raw!r}") from None
    if not value > 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


# Computations at once per worker (app/core/gate.py): torch's threads already use the worker's cores.
COMPUTE_SLOTS = 1


def available_cores(cpu_max: str = "/sys/fs/cgroup/cpu.max") -> int:
    """Cores this process may use: the cgroup CPU quota in a container (rounded down), else
    the affinity mask. os.cpu_count() alone would see the whole node from inside a pod."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open(cpu_max) as f:  # cgroup v2: "<quota> <period>" or "max <period>"
            quota, period = f.read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.floor(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def default_queue_depth() -> int:
    """Requests a worker lets wait for its compute slot: four per core of the machine (pod).

    A waiting request is worth keeping only while the slot frees soon enough for it to
    finish inside its deadline; a pod clears about one computation per core at a time, and
    two waiting per core keep every core fed through the gap between two requests (reading
    and parsing the next body while the current one computes). gthread workers do not share
    connections evenly (whichever worker wakes first accepts), so one worker's queue must
    absorb what the whole pod would hold: twice that again. Beyond it the answer is an
    immediate 503 `overloaded` that a balancer or client retries elsewhere, instead of a
    backlog that turns into deadline errors a minute later.
    """
    return 4 * available_cores()


TRUE_WORDS, FALSE_WORDS = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_bool(name: str, raw: Any, default: bool) -> bool:
    if raw is None or (isinstance(raw, str) and raw.strip() == ""):
        return default
    if isinstance(raw, bool):
        return raw
    word = str(raw).strip().lower()
    if word not in TRUE_WORDS + FALSE_WORDS:
        raise ValueError(f"{name} must be true or false (1/0, yes/no, on/off), got {raw!r}")
    return word in TRUE_WORDS


# Dask's address schemes a scheduler listens on (`host:port` alone means tcp://).
SCHEDULER_SCHEMES = ("tcp", "tls", "ws", "wss", "ucx")
NO_CLUSTER = "off"


def parse_scheduler(name: str, raw: Any, default: str | None) -> str | None:
    """A Dask scheduler's address, `off`, or unset (the default); anything else raises naming
    the variable here, not as an error at every job route and scrape."""
    if raw is None or str(raw).strip() == "":
        return default
    address = str(raw).strip()
    if address == NO_CLUSTER:
        return address
    parts = urlsplit(address if "://" in address else f"tcp://{address}")
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in SCHEDULER_SCHEMES or not parts.hostname or port is None or parts.path not in ("", "/"):
        raise ValueError(f"{name} must be {NO_CLUSTER!r} or a scheduler address such as tcp://host:8786 "
                         f"(scheme one of {', '.join(SCHEDULER_SCHEMES)}), got {raw!r}")
    return address


@dataclass(frozen=True)
class Settings:
    device: str = "auto"
    # A JSON number can take 2 bytes ("1,"): the body limit bounds the Python objects parsing makes.
    max_body_bytes: int = 32 * 1024 * 1024
    max_n: int = 8192
    max_d: int = 4096
    # Numbers in one answer (blocks + accumulated + losses): N=512, D=64 in full is 33.6M.
    max_output_elements: int = 64 * 1024 * 1024
    # Numbers in one block (rows x cols x 2D): 4M float64 is 32 MiB a tensor.
    max_block_elements: int = 4 * 1024 * 1024
    request_timeout_s: float = 60.0
    # Bytes the requests one worker holds may add to it at their peak (app/core/memory.py
    # predicts each): two workers and their idle memory fit a 4 GiB pod (docs/benchmarks.md).
    worker_memory_bytes: int = 1280 * 1024 * 1024
    # The part of it that bodies still arriving may hold together (app/core/memory.py): the
    # rest stays for requests whose bodies have arrived. Above 1 counts as 1.
    upload_memory_share: float = 0.5
    log_level: str = "INFO"
    # Optional bearer token for every route but the probes (app/http/auth.py); None = open.
    api_token: str | None = None
    # Directory of exported programs served as objectives (app/core/models.py); None = built-ins only.
    model_dir: str | None = None
    # A model objective's estimated peak activation memory for one block: pairs x bytes_per_pair
    # (README, "Model objectives").
    max_activation_bytes: int = 256 * 1024 * 1024
    # With a token set: whether /docs and /openapi.json stay open (a browser sends no token).
    docs_public: bool = True
    queue_depth: int = field(default_factory=default_queue_depth)
    read_timeout_s: float = 30.0  # head and body must arrive within it, from the head's first byte (408)
    send_timeout_s: float = 30.0  # a write making no progress this long ends the request
    # The cost model's constants (app/core/cost.py): when set, they replace its measured
    # table for every objective and dtype (tests pin them so no verdict depends on the machine).
    cost_per_block_s: float | None = None
    cost_per_number_s: float | None = None
    # Jobs (docs/jobs.md): an existing Dask scheduler's address; None: gunicorn starts an
    # embedded cluster of dask_workers single-threaded workers on 127.0.0.1.
    dask_scheduler: str | None = field(default=None, metadata={"parse": parse_scheduler})
    dask_workers: int = field(default_factory=available_cores)
    max_job_n: int = 131072
    max_job_body_bytes: int = 256 * 1024 * 1024  # .npy bodies; N = 131072 x D = 64 float64 is 64 MiB
    max_job_block_elements: int = 16 * 1024 * 1024
    max_jobs: int = 16  # queued + running, all workers and pods sharing the scheduler
    job_ttl_s: float = 3600.0  # how long a finished job and its result are kept
    max_job_results_bytes: int = 2 * 1024 * 1024 * 1024  # retained results; the oldest finished go first
    # Compute slots one request may take at once (app/core/executor.py); None: all the pod's.
    slots_per_request: int | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, Any] = os.environ) -> "Settings":
        """Each field from BLOCKGRAD_<FIELD> (upper case) or the variable its metadata's "env"
        names; a bad value raises naming the variable."""
        values: dict[str, Any] = {}
        for item in fields(cls):
            name = variable_of(item)
            raw = environ.get(name)
            default = item.default if item.default_factory is MISSING else item.default_factory()
            if "parse" in item.metadata:
                values[item.name] = item.metadata["parse"](name, raw, default)
            elif item.type is int:
                values[item.name] = parse_int(name, raw, default)
            elif item.type is float:
                values[item.name] = parse_float(name, raw, default)
            elif item.type is bool:
                values[item.name] = parse_bool(name, raw, default)
            elif item.type == float | None:
                values[item.name] = parse_float(name, raw, None)
            elif item.type == int | None:
                values[item.name] = parse_int(name, raw, None)
            elif raw:
                values[item.name] = str(raw)
        return cls(**values)


def env_name(field: str) -> str:
    return f"BLOCKGRAD_{field.upper()}"


def variable_of(item) -> str:
    """The environment variable a Settings field is read from."""
    return item.metadata.get("env") or env_name(item.name)
