"""A request's sizes: what admission, the cost model and the memory prediction read."""
from collections.abc import Mapping
from dataclasses import dataclass

from .dtypes import DEFAULT_DTYPE, DTYPES
from .errors import field_error
from .objectives import DEFAULT_OBJECTIVE, Objective
from .vectors import EMPTY_ROWS, NO_ROWS


@dataclass(frozen=True)
class Sizes:
    """N, D >= 1 once made (validation_error otherwise): every front end makes one before it admits
    a request, so no limit, cost or memory model ever reads an N or D of 0 (they divide by them).
    A factor outside 1..N or an unknown dtype never gets here: the front ends send None
    (`admissible_factor`) and the default dtype (`request_sizes`)."""
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


def admissible_factor(factor: object, n: int) -> int | None:
    """The factor as sent if it is one admission can read, else None (conversion refuses it)."""
    return factor if type(factor) is int and 1 <= factor <= n else None


def request_sizes(n: int, dim: int, factor: int | None, outputs: tuple[str, ...] | None, *, objective: object,
                  dtype: object, objectives: Mapping[str, Objective]) -> Sizes:
    """Sizes as sent; an objective or dtype left out, or one that conversion will refuse, is
    predicted as the default (a refusal is near)."""
    dtype = dtype if isinstance(dtype, str) and dtype in DTYPES else DEFAULT_DTYPE
    objective = objective if isinstance(objective, str) and objective in objectives else DEFAULT_OBJECTIVE
    return Sizes(n, dim, factor, outputs, objective=objective, dtype=dtype,
                 bytes_per_pair=getattr(objectives[objective], "bytes_per_pair", None))
