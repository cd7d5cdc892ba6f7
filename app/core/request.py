"""The request type of the computation, and the one function that builds it.

Both front ends turn what they received into keyword values and call
`build_request`, which applies the rules that need the numbers (factor within N,
values within dtype) and raises `validation_error` naming the fields.
"""
import math
from dataclasses import dataclass

import numpy as np

from .errors import validation_error
from .objectives import DEFAULT_OBJECTIVE, DEFAULT_OFFSET, OBJECTIVES
from .vectors import fits_dtype

OUTPUTS = ("blocks", "accumulated", "losses")
DEFAULT_OUTPUTS = ("blocks", "accumulated")
DTYPES = {"float32": np.float32, "float64": np.float64}
DEFAULT_DTYPE = "float32"
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

    @property
    def n(self) -> int:
        return self.vectors.shape[0]

    @property
    def dim(self) -> int:
        return self.vectors.shape[1]


def ordered_outputs(names) -> tuple[str, ...]:
    return tuple(name for name in OUTPUTS if name in names)


def build_request(vectors: np.ndarray, *, factor: int | None = None, objective: str = DEFAULT_OBJECTIVE,
                  offset: float = DEFAULT_OFFSET, outputs=DEFAULT_OUTPUTS,
                  dtype: str = DEFAULT_DTYPE) -> GradientRequest:
    """A checked GradientRequest from values of the right types (the front ends check types)."""
    n = vectors.shape[0]
    errors: dict[str, list[str]] = {}
    if factor is not None and not 1 <= factor <= n:
        errors["factor"] = [f"Must be between 1 and N = {n}."]
    if objective not in OBJECTIVES:
        errors["objective"] = [f"Must be one of: {', '.join(OBJECTIVES)}."]
    if dtype not in DTYPES:
        errors["dtype"] = [f"Must be one of: {', '.join(DTYPES)}."]
    elif not errors:
        cell = fits_dtype(vectors, DTYPES[dtype])
        if cell is not None:
            advice = "send smaller values or use dtype float64" if dtype == "float32" else "send smaller values"
            errors["vectors"] = [f"Row {cell[0]}, column {cell[1]} overflows {dtype}; {advice}."]
        elif fits_dtype(np.array([[offset]]), DTYPES[dtype]) is not None:
            errors["offset"] = [f"Overflows {dtype}."]
    if errors:
        raise validation_error(errors)
    return GradientRequest(vectors=vectors, factor=default_factor(n) if factor is None else factor,
                           objective=objective, offset=offset, outputs=ordered_outputs(outputs), dtype=dtype)
