"""The request: its sizes as sent (what admission reads), and its converted form.

Every front end first makes `Sizes` (N, D >= 1, checked), which admission reads before
any number is converted; then turns what it received into keyword values and calls
`build_request`, which applies the rules that need the numbers (factor within N,
values within dtype) and raises `validation_error` naming the fields.
"""
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from .dtypes import DEFAULT_DTYPE, DTYPES, UNKNOWN_DTYPE
from .errors import field_error, validation_error
from .objectives import DEFAULT_OBJECTIVE, DEFAULT_OFFSET, OBJECTIVES, Objective
from .vectors import EMPTY_ROWS, NO_ROWS, in_dtype

OUTPUTS = ("blocks", "accumulated", "losses")
DEFAULT_OUTPUTS = ("blocks", "accumulated")
BLOCK_CAP = 6  # default factor ceil(N / 6): blocks of about six rows


@dataclass(frozen=True)
class Sizes:
    """N, D >= 1 once made (validation_error otherwise): every front end makes one before it admits
    a request, so no limit, cost or memory model ever reads an N or D of 0 (they divide by them).
    A factor outside 1..N or an unknown dtype never gets here: `request_sizes` makes them None
    and the default dtype."""
    n: int
    dim: int
    factor: int | None  # None: not valid as sent (the request is refused when converted)
    outputs: tuple[str, ...] | None  # the core's outputs computed, in OUTPUTS order; None: not valid as sent
    objective: str = DEFAULT_OBJECTIVE
    dtype: str = DEFAULT_DTYPE
    bytes_per_pair: int | None = None  # a model objective's activations per pair; None for built-ins

    def __post_init__(self):
        if self.n < 1:
            raise field_error("vectors", NO_ROWS)
        if self.dim < 1:
            raise field_error("vectors", EMPTY_ROWS)


def request_sizes(n: int, dim: int, factor: int | None, outputs: tuple[str, ...] | None, *, objective: object,
                  dtype: object, objectives: Mapping[str, Objective]) -> Sizes:
    """Sizes as sent; a factor outside 1..N is None, and an objective or dtype left out, or one
    that conversion will refuse, is predicted as the default (conversion refuses it)."""
    factor = factor if factor_refusal(factor, n) is None else None
    dtype = dtype if isinstance(dtype, str) and dtype in DTYPES else DEFAULT_DTYPE
    objective = objective if isinstance(objective, str) and objective in objectives else DEFAULT_OBJECTIVE
    return Sizes(n, dim, factor, outputs, objective=objective, dtype=dtype,
                 bytes_per_pair=getattr(objectives[objective], "bytes_per_pair", None))


def default_factor(n: int) -> int:
    return max(1, math.ceil(n / BLOCK_CAP))


@dataclass(frozen=True)
class GradientRequest:
    vectors: np.ndarray  # (N, D) in `dtype` (build_request casts them), finite
    factor: int
    objective: str
    offset: float
    outputs: tuple[str, ...]  # in OUTPUTS order, no repeats
    dtype: str
    # What `objective` names among the server's objectives (build_request resolves it); left out,
    # the built-in of that name.
    objective_fn: Objective | None = field(default=None, repr=False, compare=False)
    n: int = field(init=False, repr=False, compare=False)  # N and D of `vectors`
    dim: int = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.objective_fn is None:
            object.__setattr__(self, "objective_fn", OBJECTIVES[self.objective])
        object.__setattr__(self, "n", self.vectors.shape[0])
        object.__setattr__(self, "dim", self.vectors.shape[1])


def ordered_outputs(names) -> tuple[str, ...]:
    return tuple(name for name in OUTPUTS if name in names)


def factor_refusal(factor: int | None, n: int | None) -> str | None:
    """Why `factor` is refused for N vectors, or None (a factor of None stands for the default);
    with N not known (the vectors are refused) only its lower bound is checked."""
    return None if factor is None or 1 <= factor <= (factor if n is None else n) else (
        "Must be at least 1." if n is None else f"Must be between 1 and N = {n}.")


def unknown_objective(objectives: Mapping[str, Objective]) -> str:
    return f"Must be one of: {', '.join(objectives)}."


def objective_fit(name: str, objective: Objective, dim: int, dtype: str) -> dict[str, list[str]]:
    """A model takes only the D and the dtype it was exported for (it is never cast); a
    built-in, any D and dtype."""
    errors = {}
    model_dim = getattr(objective, "dim", None)
    if model_dim is not None and dim != model_dim:
        errors["vectors"] = [f"Objective {name!r} takes vectors of length D = {model_dim}; got {dim}."]
    dtypes = getattr(objective, "dtypes", DTYPES)
    if dtype in DTYPES and dtype not in dtypes:
        errors["dtype"] = [f"Objective {name!r} takes {' or '.join(dtypes)} only (the dtype it was exported "
                           f"with); got {dtype}."]
    return errors


def build_request(vectors: np.ndarray, *, objectives: Mapping[str, Objective] = OBJECTIVES,
                  factor: int | None = None, objective: str = DEFAULT_OBJECTIVE,
                  offset: float = DEFAULT_OFFSET, outputs=DEFAULT_OUTPUTS,
                  dtype: str = DEFAULT_DTYPE) -> GradientRequest:
    """A checked GradientRequest from values of the right types (the front ends check types);
    `objectives`: this server's (objectives.served_objectives)."""
    n = vectors.shape[0]
    refusal = factor_refusal(factor, n)
    errors: dict[str, list[str]] = {} if refusal is None else {"factor": [refusal]}
    if objective not in objectives:
        errors["objective"] = [unknown_objective(objectives)]
    else:
        errors.update(objective_fit(objective, objectives[objective], vectors.shape[1], dtype))
    if dtype not in DTYPES:
        errors["dtype"] = [UNKNOWN_DTYPE]
    elif not errors:
        vectors, cell, offset_overflows = in_dtype(vectors, offset, np.dtype(dtype))
        if cell is not None:
            advice = "send smaller values or use dtype float64" if dtype == "float32" else "send smaller values"
            errors["vectors"] = [f"Row {cell[0]}, column {cell[1]} overflows {dtype}; {advice}."]
        elif offset_overflows:
            errors["offset"] = [f"Overflows {dtype}."]
    if errors:
        raise validation_error(errors)
    return GradientRequest(vectors=vectors, factor=default_factor(n) if factor is None else factor,
                           objective=objective, offset=offset, outputs=ordered_outputs(outputs), dtype=dtype,
                           objective_fn=objectives[objective])
