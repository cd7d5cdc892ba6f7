"""The request type of the computation, and the one function that builds it.

Both front ends turn what they received into keyword values and call
`build_request`, which applies the rules that need the numbers (factor within N,
values within dtype) and raises `validation_error` naming the fields.
"""
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from .dtypes import DEFAULT_DTYPE, DTYPES, UNKNOWN_DTYPE
from .errors import validation_error
from .objectives import DEFAULT_OBJECTIVE, DEFAULT_OFFSET, OBJECTIVES, Objective
from .served_objectives import objective_dim, objective_dtypes
from .vectors import fits_dtype

OUTPUTS = ("blocks", "accumulated", "losses")
DEFAULT_OUTPUTS = ("blocks", "accumulated")
BLOCK_CAP = 6  # default factor ceil(N / 6): blocks of about six rows


def default_factor(n: int) -> int:
    return max(1, math.ceil(n / BLOCK_CAP))


@dataclass(frozen=True)
class GradientRequest:
    vectors: np.ndarray  # (N, D), finite, every value within `dtype`
    factor: int
    objective: str
    offset: float
    outputs: tuple[str, ...]  # in OUTPUTS order, no repeats
    dtype: str
    # What `objective` names among the server's objectives (build_request resolves it); left out,
    # the built-in of that name.
    objective_fn: Objective | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if self.objective_fn is None:
            object.__setattr__(self, "objective_fn", OBJECTIVES[self.objective])

    @property
    def n(self) -> int:
        return self.vectors.shape[0]

    @property
    def dim(self) -> int:
        return self.vectors.shape[1]


def ordered_outputs(names) -> tuple[str, ...]:
    return tuple(name for name in OUTPUTS if name in names)


def factor_out_of_range(n: int) -> str:
    return f"Must be between 1 and N = {n}."


def unknown_objective(objectives: Mapping[str, Objective]) -> str:
    return f"Must be one of: {', '.join(objectives)}."


def objective_fit(name: str, objective: Objective, dim: int, dtype: str) -> dict[str, list[str]]:
    """A model takes only the D and the dtype it was exported for (it is never cast)."""
    errors = {}
    model_dim = objective_dim(objective)
    if model_dim is not None and dim != model_dim:
        errors["vectors"] = [f"Objective {name!r} takes vectors of length D = {model_dim}; got {dim}."]
    dtypes = objective_dtypes(objective)
    if dtype in DTYPES and dtype not in dtypes:
        errors["dtype"] = [f"Objective {name!r} takes {' or '.join(dtypes)} only (the dtype it was exported "
                           f"with); got {dtype}."]
    return errors


def build_request(vectors: np.ndarray, *, objectives: Mapping[str, Objective] = OBJECTIVES,
                  factor: int | None = None, objective: str = DEFAULT_OBJECTIVE,
                  offset: float = DEFAULT_OFFSET, outputs=DEFAULT_OUTPUTS,
                  dtype: str = DEFAULT_DTYPE) -> GradientRequest:
    """A checked GradientRequest from values of the right types (the front ends check types);
    `objectives`: this server's (app/core/served_objectives.py)."""
    n = vectors.shape[0]
    errors: dict[str, list[str]] = {}
    if factor is not None and not 1 <= factor <= n:
        errors["factor"] = [factor_out_of_range(n)]
    if objective not in objectives:
        errors["objective"] = [unknown_objective(objectives)]
    else:
        errors.update(objective_fit(objective, objectives[objective], vectors.shape[1], dtype))
    if dtype not in DTYPES:
        errors["dtype"] = [UNKNOWN_DTYPE]
    elif not errors:
        cell = fits_dtype(vectors, np.dtype(dtype))
        if cell is not None:
            advice = "send smaller values or use dtype float64" if dtype == "float32" else "send smaller values"
            errors["vectors"] = [f"Row {cell[0]}, column {cell[1]} overflows {dtype}; {advice}."]
        elif fits_dtype(np.array([[offset]]), np.dtype(dtype)) is not None:
            errors["offset"] = [f"Overflows {dtype}."]
    if errors:
        raise validation_error(errors)
    return GradientRequest(vectors=vectors, factor=default_factor(n) if factor is None else factor,
                           objective=objective, offset=offset, outputs=ordered_outputs(outputs), dtype=dtype,
                           objective_fn=objectives[objective])
