"""The objectives this server serves: the built-ins (objectives.py), then the models of
BLOCKGRAD_MODEL_DIR (models.py), and what a request or GET /v1/objectives reads of each.

Built once per app (create_app) and passed explicitly to `build_request`; the
request then carries the resolved objective, so `run` needs no lookup.
"""
from typing import Any

from .dtypes import DTYPES
from .models import ModelObjective, load_models
from .objectives import OBJECTIVES, Objective
from .settings import Settings

ALL_DTYPES = tuple(DTYPES)


def served_objectives(settings: Settings) -> dict[str, Objective]:
    """Built-ins first, then models by name; raises ModelError for a file that cannot be served."""
    return {**OBJECTIVES, **load_models(settings.model_dir, OBJECTIVES)}


def objective_dim(objective: Objective) -> int | None:
    """The D a model was exported for; None: any D (built-ins)."""
    return objective.dim if isinstance(objective, ModelObjective) else None


def objective_dtypes(objective: Objective) -> tuple[str, ...]:
    return objective.dtypes if isinstance(objective, ModelObjective) else ALL_DTYPES


def describe(name: str, objective: Objective) -> dict[str, Any]:
    """One entry of GET /v1/objectives."""
    if isinstance(objective, ModelObjective):
        return {"name": name, "kind": "model", "dim": objective.dim, "dtypes": list(objective.dtypes),
                "description": objective.description, "file": objective.file.name,
                "size_bytes": objective.size_bytes, "parameters": objective.parameter_count,
                "bytes_per_pair": objective.bytes_per_pair}
    return {"name": name, "kind": "builtin", "dim": None, "dtypes": list(ALL_DTYPES),
            "description": objective.description}
