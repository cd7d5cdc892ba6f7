"""The core's settings, and the reader every layer's settings use: a frozen dataclass whose
fields are read once from environment variables, with defaults. Each layer keeps its own
fields beside its code (app/http/settings.py, app/jobs/settings.py, app/serving's).

Standard library only, so that gunicorn.conf.py can import it without torch.
The limits are sized so that a 2-core, 24 GiB machine serves every request it
accepts (docs/configuration.md).
"""
import math
import os
from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass, field, fields
from typing import Any


# Each parser takes the variable's name and its value, never unset or blank (from_env keeps
# the field's default then).
def parse_int(name: str, raw: Any) -> int:
    try:
        value = int(raw) if not isinstance(raw, bool) else None
    except ValueError:
        value = None
    if value is None:
        raise ValueError(f"{name} must be an integer, got {raw!r}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    return value


def parse_float(name: str, raw: Any) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {raw!r}") from None
    if not value > 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


# Compute slots of a process outside gunicorn (tests, tools); under gunicorn every worker
# shares the pod's, one per core (app/serving/slots.py).
COMPUTE_SLOTS = 1


def available_cores(cpu_max: str = "/sys/fs/cgroup/cpu.max") -> int:
    """Cores this process may use: the cgroup CPU quota in a container (rounded down), else
    the affinity mask. os.cpu_count() alone would see the whole node from inside a pod."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    with suppress(OSError, ValueError):
        with open(cpu_max) as f:  # cgroup v2: "<quota> <period>" or "max <period>"
            quota, period = f.read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.floor(int(quota) / int(period))))
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


def parse_bool(name: str, raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    word = str(raw).strip().lower()
    if word not in TRUE_WORDS + FALSE_WORDS:
        raise ValueError(f"{name} must be true or false (1/0, yes/no, on/off), got {raw!r}")
    return word in TRUE_WORDS


PARSERS = {int: parse_int, float: parse_float, bool: parse_bool, int | None: parse_int, float | None: parse_float}


class FromEnv:
    """Base of every layer's settings (a frozen dataclass): `from_env` reads its fields."""

    @classmethod
    def from_env(cls, environ: Mapping[str, Any] = os.environ):
        """Each field from BLOCKGRAD_<FIELD> (upper case) or the variable its metadata's "env"
        names, parsed by its metadata's "parse" or its type's parser (else as a string); unset
        or blank keeps the default; a bad value raises naming the variable."""
        values: dict[str, Any] = {}
        for item in fields(cls):
            name = variable_of(item)
            raw = environ.get(name)
            if raw is not None and not (isinstance(raw, str) and raw.strip() == ""):
                parse = item.metadata.get("parse") or PARSERS.get(item.type, lambda name, raw: str(raw))
                values[item.name] = parse(name, raw)
        return cls(**values)


def environment(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The environment with the BLOCKGRAD_* keys of `overrides` over it (create_app's)."""
    return {**os.environ, **{k: v for k, v in overrides.items() if k.startswith("BLOCKGRAD_")}}


@dataclass(frozen=True)
class Settings(FromEnv):
    """The core's fields; app/http/settings.py's Settings adds the HTTP layer's."""
    device: str = "auto"
    max_n: int = 8192
    max_d: int = 4096
    # Numbers in one answer (blocks + accumulated + losses): N=512, D=64 in full is 33.6M.
    max_output_elements: int = 64 * 1024 * 1024
    # Numbers in one block (rows x cols x 2D): 4M float64 is 32 MiB a tensor.
    max_block_elements: int = 4 * 1024 * 1024
    request_timeout_s: float = 60.0
    # Head and body must arrive within it, from the head's first byte (408): app/http's body
    # reader counts it, and app/serving's worker caps its header timeout by it.
    read_timeout_s: float = 30.0
    # Bytes the requests one worker holds may add to it at their peak (app/core/admission.py
    # predicts each): two workers and their idle memory fit a 4 GiB pod (docs/benchmarks.md).
    worker_memory_bytes: int = 1280 * 1024 * 1024
    # The part of it that bodies still arriving may hold together (app/core/admission.py): the
    # rest stays for requests whose bodies have arrived. Above 1 counts as 1.
    upload_memory_share: float = 0.5
    # Directory of exported programs served as objectives (app/core/models.py); None = built-ins only.
    model_dir: str | None = None
    # A model objective's estimated peak activation memory for one block: pairs x bytes_per_pair
    # (docs/models.md).
    max_activation_bytes: int = 256 * 1024 * 1024
    queue_depth: int = field(default_factory=default_queue_depth)
    # The cost model's constants (app/core/admission.py): when set, they replace its measured
    # table for every objective and dtype (tests pin them so no verdict depends on the machine).
    cost_per_block_s: float | None = None
    cost_per_number_s: float | None = None
    # Compute slots one request may take at once (app/core/run.py); None: all the pod's.
    slots_per_request: int | None = None


def variable_of(item) -> str:
    """The environment variable a Settings field is read from."""
    return item.metadata.get("env") or f"BLOCKGRAD_{item.name.upper()}"
