"""Every request and response shape, in one module.

The same schemas validate requests and produce the OpenAPI document. Loading a
request hands the view a typed `GradientRequest` (post_load), never a dict.
"""
from dataclasses import dataclass

import numpy as np
from marshmallow import Schema, ValidationError, fields, post_load, validates_schema
from marshmallow.validate import Length, OneOf, Range

from .engine import default_factor
from .objectives import DEFAULT_OBJECTIVE, DEFAULT_OFFSET, OBJECTIVES
from .vectors import MatrixError, check_matrix, fits_dtype, parse_matrix

OUTPUTS = ("blocks", "accumulated", "losses")
DEFAULT_OUTPUTS = ("blocks", "accumulated")
DTYPES = {"float32": np.float32, "float64": np.float64}
DEFAULT_DTYPE = "float32"


@dataclass(frozen=True)
class GradientRequest:
    vectors: np.ndarray  # (N, D) float64 (or float32 from /v2 binary data), finite, fits `dtype`
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


class Vectors(fields.Field):
    """A list of N rows of D JSON numbers, loaded as one (N, D) float64 array.

    An (N, D) float array (binary tensor data, /v2) is checked by the same rules as is.
    """

    def _deserialize(self, value, attr, data, **kwargs) -> np.ndarray:
        try:
            if isinstance(value, np.ndarray):
                return check_matrix(value)
            return parse_matrix(value)
        except MatrixError as exc:
            raise ValidationError(str(exc)) from None


class JsonNumber(fields.Float):
    """A finite JSON number; strings and booleans are refused, not coerced."""

    def _deserialize(self, value, attr, data, **kwargs):
        if isinstance(value, (str, bool)):
            raise self.make_error("invalid")
        return super()._deserialize(value, attr, data, **kwargs)


class GradientRequestSchema(Schema):
    vectors = Vectors(required=True, metadata={
        "type": "array", "minItems": 1, "items": {"type": "array", "minItems": 1, "items": {"type": "number"}},
        "description": "N rows of D finite numbers (V, shape (N, D)); all rows the same length, no strings, "
                       "booleans, nulls, NaN or infinities, every value within `dtype`'s range. "
                       "N is at most BLOCKGRAD_MAX_N and D at most BLOCKGRAD_MAX_D (413 limit_exceeded; "
                       "this server's values are in the description at the top).",
        "example": [[0.5, -1.0], [2.0, 0.25], [1.5, 3.0]],
    })
    factor = fields.Integer(strict=True, validate=Range(min=1), metadata={
        "description": "Split factor F, an integer with 1 <= F <= N (booleans, floats and strings are refused); "
                       "the matrix is cut into F x F blocks, the last row and column of blocks taking the "
                       "remainder. Default ceil(N / 6). The largest block (side x side x 2D numbers) must fit "
                       "BLOCKGRAD_MAX_BLOCK_ELEMENTS (413 limit_exceeded names the smallest factor that fits)."})
    objective = fields.String(load_default=DEFAULT_OBJECTIVE, validate=OneOf(OBJECTIVES), metadata={
        "description": "Loss of one block B: sum = sum(B + offset), mean = mean(B), sum_of_squares = sum(B*B), "
                       "l2_norm = ||B||_2 (gradient 0 where the norm is 0), logsumexp = log(sum(exp(B)))."})
    offset = JsonNumber(load_default=DEFAULT_OFFSET, metadata={
        "description": "Added to every entry by the `sum` objective (the seed's i + 5); a finite number "
                       "within `dtype`'s range. Ignored by the other objectives."})
    outputs = fields.List(fields.String(validate=OneOf(OUTPUTS)), load_default=DEFAULT_OUTPUTS,
                          validate=Length(min=1), metadata={
        "description": "Which parts to return: a non-empty subset of blocks, accumulated, losses (repeats "
                       "are ignored). The answer's numbers (blocks N*N*2D, accumulated N*D, losses F*F) must "
                       "fit BLOCKGRAD_MAX_OUTPUT_ELEMENTS (413 limit_exceeded)."})
    dtype = fields.String(load_default=DEFAULT_DTYPE, validate=OneOf(DTYPES), metadata={
        "description": "Precision of all arithmetic and of every output number (written with the shortest "
                       "digits that round-trip in it)."})

    @validates_schema
    def check_against_vectors(self, data, **kwargs):
        vectors, dtype = data["vectors"], DTYPES[data["dtype"]]
        n = vectors.shape[0]
        if "factor" in data and data["factor"] > n:
            raise ValidationError(f"Must be between 1 and N = {n}.", "factor")
        cell = fits_dtype(vectors, dtype)
        if cell is not None:
            advice = "send smaller values or use dtype float64" if data["dtype"] == "float32" else "send smaller values"
            raise ValidationError(
                f"Row {cell[0]}, column {cell[1]} overflows {data['dtype']}; {advice}.", "vectors")
        if fits_dtype(np.array([[data["offset"]]]), dtype) is not None:
            raise ValidationError(f"Overflows {data['dtype']}.", "offset")

    @post_load
    def make_request(self, data, **kwargs) -> GradientRequest:
        return GradientRequest(
            vectors=data["vectors"],
            factor=data.get("factor", default_factor(data["vectors"].shape[0])),
            objective=data["objective"],
            offset=data["offset"],
            outputs=tuple(name for name in OUTPUTS if name in data["outputs"]),
            dtype=data["dtype"],
        )


class BlockSchema(Schema):
    row = fields.Integer(required=True, metadata={"description": "Row block index r, 0..F-1."})
    col = fields.Integer(required=True, metadata={"description": "Column block index c, 0..F-1."})
    rows = fields.List(fields.Integer(), required=True, metadata={
        "minItems": 2, "maxItems": 2, "description": "[start, stop) of the block's rows in V."})
    cols = fields.List(fields.Integer(), required=True, metadata={
        "minItems": 2, "maxItems": 2, "description": "[start, stop) of the block's columns in V."})
    loss = fields.Float(required=True, metadata={"description": "The objective of this block, in `dtype`."})
    gradient = fields.Raw(required=True, metadata={
        "type": "array", "description": "dL/dB, shape (rows, cols, 2D): entry [i][j] is the gradient with "
                                        "respect to concat(V[start_row + i], V[start_col + j]).",
        "items": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}}})


class GradientResponseSchema(Schema):
    n = fields.Integer(required=True, metadata={"description": "Number of vectors N."})
    dim = fields.Integer(required=True, metadata={"description": "Vector length D."})
    factor = fields.Integer(required=True, metadata={"description": "The split factor F used."})
    bounds = fields.List(fields.Integer(), required=True, metadata={
        "description": "F + 1 block boundaries [0, base, ..., (F-1)*base, N], base = N // F."})
    objective = fields.String(required=True, metadata={"description": "The objective used."})
    dtype = fields.String(required=True, metadata={"description": "The precision used."})
    device = fields.String(required=True, metadata={"description": "Where it was computed, e.g. cpu or cuda:0."})
    accumulated = fields.Raw(metadata={
        "type": "array", "items": {"type": "array", "items": {"type": "number"}},
        "description": "Sum over blocks of dL(block)/dV, shape (N, D). Only if asked for."})
    losses = fields.Raw(metadata={
        "type": "array", "items": {"type": "array", "items": {"type": "number"}},
        "description": "losses[r][c] = L(block r, c), shape (F, F). Only if asked for."})
    blocks = fields.List(fields.Nested(BlockSchema), metadata={
        "description": "Every block, row-block-major (r outer, c inner); streamed as computed. "
                       "Only if asked for."})


class HealthSchema(Schema):
    status = fields.String(required=True, metadata={"example": "ok", "description": "Always `ok`."})


class ReadySchema(Schema):
    status = fields.String(required=True, metadata={"example": "ready", "description": "Always `ready`."})
    device = fields.String(required=True, metadata={
        "example": "cpu", "description": "The device this worker computes on (BLOCKGRAD_DEVICE resolved)."})


class ErrorDetailSchema(Schema):
    code = fields.String(required=True, metadata={
        "description": "Stable snake_case error code (the table in the description at the top)."})
    message = fields.String(required=True, metadata={"description": "What went wrong and what to change."})
    details = fields.Dict(metadata={
        "description": "Optional: `fields` (validation_error: field -> list of messages), `limit`, `value`, "
                       "`allowed` (limit_exceeded), `block` (non_finite_result), `timeout_s` (deadline_exceeded)."})


class ErrorSchema(Schema):
    error = fields.Nested(ErrorDetailSchema, required=True)
