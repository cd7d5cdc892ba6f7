"""A request's sizes: what admission, the cost model and the memory prediction read."""
from collections.abc import Mapping
from dataclasses import dataclass

from .dtypes import DEFAULT_DTYPE, DTYPES, UNKNOWN_DTYPE
from .errors import field_error
from .objectives import DEFAULT_OBJECTIVE, Objective
from .request import factor_out_of_range
from .vectors import EMPTY_ROWS, NO_ROWS


@dataclass(frozen=True)
class Sizes:
    """Valid once made (validation_error otherwise): every front end makes one before it admits a
    request, so no limit, cost or memory model ever reads an N or D of 0 (they divide by them)."""
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
        if self.factor is not None and not 1 <= self.factor <= self.n:
            raise field_error("factor", factor_out_of_range(self.n))
        if self.dtype not in DTYPES:
            raise field_error("dtype", UNKNOWN_DTYPE)


def request_sizes(n: int, dim: int, factor: int | None, outputs: tuple[str, ...] | None, *, objective: object,
                  dtype: object, objectives: Mapping[str, Objective]) -> Sizes:
    """Sizes as sent; an objective or dtype left out, or one that conversion will refuse, is
    predicted as the default (a refusal is near)."""
    dtype = dtype if isinstance(dtype, str) and dtype in DTYPES else DEFAULT_DTYPE
    objective = objective if isinstance(objective, str) and objective in objectives else DEFAULT_OBJECTIVE
    return Sizes(n, dim, factor, outputs, objective=objective, dtype=dtype,
                 bytes_per_pair=getattr(objectives[objective], "bytes_per_pair", None))
