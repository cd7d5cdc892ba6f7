"""A model objective's program on the cluster: its file's bytes scattered to every worker
under a key named by their sha256, once per service process and program. This process
keeps the future, so the bytes stay on the workers for every later job with the same
program (a worker that joins later fetches them from a peer when a task needs them);
each worker loads and checks them once (app/core/job_models.py)."""
import threading

from ..core.errors import cluster_unavailable
from ..core.job_models import program_hash
from ..core.models import ModelObjective
from .client import call, time_left

PROGRAM_KEY = "blockgrad-program-"

_lock = threading.Lock()
_futures: dict[tuple[str, str], object] = {}  # (client id, key) -> the scattered program's future


def program_key(sha256: str) -> str:
    return PROGRAM_KEY + sha256


def shipped_program(client, objective, timeout_s: float):
    """(sha256, the future of the model's program on the cluster), scattered now if this
    process has not yet or if it was lost; None for a built-in objective."""
    if not isinstance(objective, ModelObjective):
        return None
    data = objective.program  # the bytes the service loaded and serves /v1 with: checked again on every worker
    sha256 = program_hash(data)
    key = program_key(sha256)
    address = client.scheduler.address
    if not _lock.acquire(timeout=time_left(address, timeout_s)):  # another route ships it: within this one's bound
        raise cluster_unavailable(address)
    try:
        future = _futures.get((client.id, key))
        if future is None or future.status != "finished":
            shipped = call(client, client._scatter, {key: data}, broadcast=True, hash=False, timeout_s=timeout_s)
            future = _futures[(client.id, key)] = shipped[key]
        return sha256, future
    finally:
        _lock.release()
