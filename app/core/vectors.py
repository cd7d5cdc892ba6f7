"""Turn the JSON `vectors` value into an (N, D) float64 array in one vectorised pass.

Checks happen on whole rows or the whole matrix at C speed; only when a check
fails do we walk the values to name the first offending row and column.
"""
from dataclasses import dataclass
from itertools import chain
from math import prod

import numpy as np

NUMBER_TYPES = frozenset((float, int))
JSON_TYPE_NAMES = {bool: "a boolean", str: "a string", type(None): "null", list: "a list", dict: "an object"}


NO_ROWS = "Must be a non-empty list of rows, each a list of numbers."
EMPTY_ROWS = "Rows must not be empty."


class MatrixError(ValueError):
    """A message a person can act on, naming the offending row and column."""


def parse_matrix(value: object) -> np.ndarray:
    if not isinstance(value, list) or not value:
        raise MatrixError(NO_ROWS)
    for i, row in enumerate(value):
        if type(row) is not list:
            raise MatrixError(f"Row {i} is {json_type(row)}, not a list of numbers.")
    width = len(value[0])
    if width == 0:
        raise MatrixError(EMPTY_ROWS)
    if any(len(row) != width for row in value):
        i = next(i for i, row in enumerate(value) if len(row) != width)
        raise MatrixError(f"Rows must all have the same length: row 0 has {width} numbers, row {i} has {len(value[i])}.")
    return check_finite(float64_array(value, chain.from_iterable(value),  # (N, D)
                                      lambda: ((i, j, x) for i, row in enumerate(value) for j, x in enumerate(row))))


def float64_array(value: list, numbers, cells) -> np.ndarray:
    """`value` (rows, or flat numbers) as one float64 array. `numbers`: its items, flat;
    `cells()`: (row, column, item) in order, walked only to name the first refused item."""
    if not set(map(type, numbers)) <= NUMBER_TYPES:
        i, j, x = next(cell for cell in cells() if type(cell[2]) not in NUMBER_TYPES)
        raise MatrixError(f"Row {i}, column {j} is {json_type(x)}; only numbers are allowed.")
    try:
        return np.array(value, dtype=np.float64)
    except OverflowError:  # an integer beyond float64
        i, j, _ = next(cell for cell in cells() if not np.isfinite(float_or_inf(cell[2])))
        raise MatrixError(f"Row {i}, column {j} is too large for a 64-bit float.") from None


@dataclass(frozen=True)
class Buffer:
    """Binary tensor data as sent: row-major numbers of `dtype` (byte order included), no padding."""
    data: memoryview
    dtype: np.dtype


def to_matrix(vectors: object, shape: tuple[int, int] | None = None) -> np.ndarray:
    """A request's vectors as a checked (N, D) float array: an array decoded elsewhere (a .npy),
    a Buffer of the declared `shape`, JSON rows, or, with `shape` declared, JSON data nested in
    exactly that shape or flat and row-major (one array at once, never through row lists).
    An array or a Buffer is (N, D) with N, D >= 1 already: its sizes were validated (`Sizes`)
    before it is converted."""
    if isinstance(vectors, np.ndarray):
        return check_finite(vectors)
    if isinstance(vectors, Buffer):
        return check_finite(decode_tensor(vectors.data, vectors.dtype, list(shape)))
    if shape is None:
        return parse_matrix(vectors)
    n, dim = shape
    if not isinstance(vectors, list):
        raise MatrixError("data must be a list of numbers, flat or nested.")
    if vectors and isinstance(vectors[0], list):
        lengths = {len(row) if isinstance(row, list) else -1 for row in vectors}
        if len(vectors) != n or lengths != {dim}:
            raise MatrixError(f"nested data does not have the declared shape {list(shape)}.")
        return parse_matrix(vectors)
    if len(vectors) != n * dim:
        raise MatrixError(f"shape {list(shape)} takes {n * dim} numbers, data has {len(vectors)}.")
    return parse_flat(vectors, n, dim)


def decode_tensor(buffer: memoryview, dtype: np.dtype, shape: list[int]) -> np.ndarray:
    """A tensor's binary data -> a writable array of that shape, in native byte order."""
    expected = prod(shape) * dtype.itemsize
    if len(buffer) != expected:
        raise MatrixError(f"Shape {shape} of {dtype.itemsize}-byte numbers takes {expected} bytes, "
                          f"but {len(buffer)} were sent.")
    try:
        # A copy (of the input, small next to the output): torch will not share read-only memory.
        return np.frombuffer(buffer, dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="))
    except (ValueError, OverflowError) as exc:  # e.g. a dimension past what numpy can index
        raise MatrixError(f"Shape {shape} cannot be read as a tensor: {exc}.") from None


def check_finite(matrix: np.ndarray) -> np.ndarray:
    if not np.isfinite(matrix).all():
        i, j = (int(k) for k in np.argwhere(~np.isfinite(matrix))[0])
        raise MatrixError(f"Row {i}, column {j} is not a finite number.")
    return matrix


def in_dtype(matrix: np.ndarray, offset: float, dtype: np.dtype) -> tuple[np.ndarray, tuple[int, int] | None, bool]:
    """A finite `matrix` and `offset` cast to `dtype` (no copy when already in it): the matrix
    the engine computes on, the first (row, col) that overflowed (None: none did), and whether
    the offset did."""
    with np.errstate(over="ignore"):  # an overflow becomes inf: found here
        cast, offset_cast = matrix.astype(dtype, copy=False), dtype.type(offset)
    finite = np.isfinite(cast)
    return cast, None if finite.all() else tuple(int(k) for k in np.argwhere(~finite)[0]), not np.isfinite(offset_cast)


def float_or_inf(x: int | float) -> float:
    try:
        return float(x)
    except OverflowError:
        return float("inf")


def json_type(x: object) -> str:
    return JSON_TYPE_NAMES.get(type(x), "a number")


def parse_flat(values: list, n: int, dim: int) -> np.ndarray:
    """N x D JSON numbers, flat and row-major, as one (N, D) float64 array (no row lists);
    the same rules and messages as parse_matrix. `values` holds exactly N x D items."""
    flat = float64_array(values, values, lambda: ((k // dim, k % dim, x) for k, x in enumerate(values)))  # (N * D,)
    return check_finite(flat.reshape(n, dim))  # a view: no copy
