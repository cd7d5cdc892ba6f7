"""A job's model objective on a cluster worker: the operator's exported program, shipped by
content (its bytes, named by their sha256), loaded and checked once per worker process.

The checks are the service's own (`models.load_model`: the input signature, the probe,
the independence of pairs, the activation memory), run on the bytes the service read, and
the program must still take the job's D and dtype. A program that fails them fails the job.
The loaded objective is kept by hash, so every later task and job with the same program
reuses it.

Pure module: bytes and names in, an Objective out (loaded from memory: no file on the worker).
"""
import hashlib
import threading
from collections import Counter
from pathlib import Path

from .errors import job_failed
from .models import MODEL_SUFFIX, ModelError, ModelObjective, load_model
from .objectives import OBJECTIVES, Objective

_lock = threading.Lock()
_loaded: dict[tuple[str, str], "ModelObjective | ProgramError"] = {}  # (sha256, name) -> checked, or why not
_loads: Counter = Counter()  # sha256 -> programs loaded by this process


class ProgramError(Exception):
    """The program cannot serve this job here; `error` is the job's {"code", "message", "details"}."""

    def __init__(self, error: dict):
        super().__init__(error["message"])
        self.error = error


def program_hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def program_failed(name: str, reason: str) -> dict:
    """The job's error: the operator's deployment, not the request, is at fault."""
    return job_failed(f"The model objective {name!r} failed its load checks on a cluster worker: {reason} "
                      "The workers must run the service's image (the same torch).", objective=name).as_dict()


def job_objective(name: str, dim: int, dtype: str, sha256: str | None, data: bytes | None) -> Objective:
    """A built-in by name, or the model whose program is `data` (sha256 its hash), checked."""
    if sha256 is None:
        return OBJECTIVES[name]
    with _lock:  # one load per process, even if tasks ever run on several threads
        objective = _loaded.get((sha256, name))
        if objective is None:
            try:
                objective = load_program(name, sha256, data)
            except ProgramError as exc:
                objective = exc  # the job's other tiles here fail at once, not after another load
            _loaded[(sha256, name)] = objective
    if isinstance(objective, ProgramError):
        raise objective
    if (objective.dim, objective.dtype) != (dim, dtype):
        raise ProgramError(program_failed(name, f"it takes D = {objective.dim} in {objective.dtype}, the job "
                                                f"D = {dim} in {dtype}."))
    return objective


def load_program(name: str, sha256: str, data: bytes | None) -> ModelObjective:
    if data is None or program_hash(data) != sha256:
        raise ProgramError(program_failed(name, "the program's bytes do not match their hash."))
    _loads[sha256] += 1
    try:
        return load_model(name, Path(f"{name}{MODEL_SUFFIX}"), data)
    except ModelError as exc:
        raise ProgramError(program_failed(name, str(exc))) from None


def program_loads() -> dict[str, int]:
    """sha256 -> how many times this process loaded that program (once, unless it failed)."""
    return dict(_loads)
