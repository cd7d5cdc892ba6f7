"""A model objective's program on the cluster: its file's bytes scattered to every worker
under a key named by their sha256, once per Client and program. The runner keeps the
future, so the bytes stay on the workers for every later job with the same program (a
worker that joins later fetches them from a peer when a task needs them); each worker
loads and checks them once (app/core/job_models.py)."""
from ..core.job_models import program_hash
from ..core.models import ModelObjective

PROGRAM_KEY = "blockgrad-program-"

_futures: dict[tuple[str, str], object] = {}  # (client id, key) -> the scattered program's future


def program_key(sha256: str) -> str:
    return PROGRAM_KEY + sha256


def shipped_program(client, objective, timeout_s: float):
    """(sha256, the future of the model's program on the cluster), scattered now if this
    Client has not yet or if it was lost; None for a built-in objective."""
    if not isinstance(objective, ModelObjective):
        return None
    data = objective.program  # the bytes the service loaded and serves /v1 with: checked again on every worker
    sha256 = program_hash(data)
    key = program_key(sha256)
    future = _futures.get((client.id, key))
    if future is None or future.status != "finished":
        future = _futures[(client.id, key)] = client.scatter({key: data}, broadcast=True, hash=False,
                                                              timeout=timeout_s)[key]
    return sha256, future
