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
from .vectors import MatrixError, fits_dtype, parse_matrix

OUTPUTS = ("blocks", "accumulated", "losses")
DEFAULT_OUTPUTS = ("blocks", "accumulated")
DTYPES = {"float32": np.float32, "float64": np.float64}
DEFAULT_DTYPE = "float32"


@dataclass(frozen=True)
class GradientRequest:
    vectors: np.ndarray  # (N, D) float64, finite, fits `dtype`
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
    """A list of N rows of D JSON numbers, loaded as one (N, D) float64 array."""

    def _deserialize(self, value, attr, data, **kwargs) -> np.ndarray:
        try:
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
        "description": "N rows of D finite numbers (V, shape (N, D)); all rows the same length.",
        "example": [[0.5, -1.0], [2.0, 0.25], [1.5, 3.0]],
    })
    factor = fields.Integer(strict=True, validate=Range(min=1), metadata={
        "description": "Split factor F, 1 <= F <= N; blocks are F x F. Default ceil(N / 6)."})
    objective = fields.String(load_default=DEFAULT_OBJECTIVE, validate=OneOf(OBJECTIVES), metadata={
        "description": "Loss of one block B: sum(B + offset), mean(B), sum(B*B), ||B||_2 or logsumexp(B)."})
    offset = JsonNumber(load_default=DEFAULT_OFFSET, metadata={
        "description": "Added to every entry by the `sum` objective (the seed's i + 5)."})
    outputs = fields.List(fields.String(validate=OneOf(OUTPUTS)), load_default=DEFAULT_OUTPUTS,
                          validate=Length(min=1), metadata={
        "description": "Which parts to return: a non-empty subset of blocks, accumulated, losses."})
    dtype = fields.String(load_default=DEFAULT_DTYPE, validate=OneOf(DTYPES), metadata={
        "description": "Arithmetic and output precision."})

    @validates_schema
    def check_against_vectors(self, data, **kwargs):
        vectors, dtype = data["vectors"], DTYPES[data["dtype"]]
        n = vectors.shape[0]
        if "factor" in data and data["factor"] > n:
            raise ValidationError(f"Must be between 1 and N = {n}.", "factor")
        cell = fits_dtype(vectors, dtype)
        if cell is not None:
            raise ValidationError(
                f"Row {cell[0]}, column {cell[1]} overflows {data['dtype']}; "
                "send smaller values or use dtype float64.", "vectors")
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
    row = fields.Integer(metadata={"description": "Row block index r, 0..F-1."})
    col = fields.Integer(metadata={"description": "Column block index c, 0..F-1."})
    rows = fields.List(fields.Integer(), metadata={"description": "[start, stop) of the block's rows in V."})
    cols = fields.List(fields.Integer(), metadata={"description": "[start, stop) of the block's columns in V."})
    loss = fields.Float(metadata={"description": "The objective of this block."})
    gradient = fields.Raw(metadata={
        "type": "array", "description": "dL/dB, shape (rows, cols, 2D).",
        "items": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}}})


class GradientResponseSchema(Schema):
    n = fields.Integer(metadata={"description": "Number of vectors N."})
    dim = fields.Integer(metadata={"description": "Vector length D."})
    factor = fields.Integer(metadata={"description": "The split factor F used."})
    bounds = fields.List(fields.Integer(), metadata={"description": "F + 1 block boundaries."})
    objective = fields.String()
    dtype = fields.String()
    device = fields.String(metadata={"description": "Where it was computed, e.g. cpu or cuda:0."})
    accumulated = fields.Raw(metadata={
        "type": "array", "items": {"type": "array", "items": {"type": "number"}},
        "description": "Sum over blocks of dL(block)/dV, shape (N, D). Only if asked for."})
    losses = fields.Raw(metadata={
        "type": "array", "items": {"type": "array", "items": {"type": "number"}},
        "description": "losses[r][c] = L(block r, c), shape (F, F). Only if asked for."})
    blocks = fields.List(fields.Nested(BlockSchema), metadata={
        "description": "Every block, row-block-major. Only if asked for."})


class HealthSchema(Schema):
    status = fields.String(metadata={"example": "ok"})


class ReadySchema(Schema):
    status = fields.String(metadata={"example": "ready"})
    device = fields.String(metadata={"example": "cpu"})


class ErrorDetailSchema(Schema):
    code = fields.String(metadata={"description": "Stable snake_case error code."})
    message = fields.String(metadata={"description": "What went wrong and what to change."})
    details = fields.Dict(metadata={"description": "Optional, e.g. per-field messages under `fields`."})


class ErrorSchema(Schema):
    error = fields.Nested(ErrorDetailSchema)
