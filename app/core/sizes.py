"""A request's sizes: what admission, the cost model and the memory prediction read."""
from collections.abc import Mapping
from dataclasses import dataclass

from .dtypes import DEFAULT_DTYPE, DTYPES
from .objectives import DEFAULT_OBJECTIVE, Objective


@dataclass(frozen=True)
class Sizes:
    n: int
    dim: int
    factor: int | None  # None: not valid as sent (the request is refused when converted)
    outputs: tuple[str, ...] | None  # the core's outputs computed, in OUTPUTS order; None: not valid as sent
    objective: str = DEFAULT_OBJECTIVE
    dtype: str = DEFAULT_DTYPE
    bytes_per_pair: int | None = None  # a model objective's activations per pair; None for built-ins


def request_sizes(n: int, dim: int, factor: int | None, outputs: tuple[str, ...] | None, *, objective: object,
                  dtype: object, objectives: Mapping[str, Objective]) -> Sizes:
    """Sizes as sent; an objective or dtype left out, or one that conversion will refuse, is
    predicted as the default (a refusal is near)."""
    dtype = dtype if isinstance(dtype, str) and dtype in DTYPES else DEFAULT_DTYPE
    objective = objective if isinstance(objective, str) and objective in objectives else DEFAULT_OBJECTIVE
    return Sizes(n, dim, factor, outputs, objective=objective, dtype=dtype,
                 bytes_per_pair=getattr(objectives[objective], "bytes_per_pair", None))
