"""/v1's request and response shapes.

The same schemas check a request's JSON types field by field (the decoder, before
admission: every field but `vectors`, whose rows the pipeline converts after it) and
produce the OpenAPI document.
"""
from marshmallow import Schema, fields
from marshmallow.validate import Length, OneOf

from ...core.dtypes import DEFAULT_DTYPE, DTYPES
from ...core.objectives import DEFAULT_OBJECTIVE, DEFAULT_OFFSET
from ...core.request import DEFAULT_OUTPUTS, OUTPUTS
from ..fields import JsonNumber, ObjectiveName


class GradientRequestSchema(Schema):
    # Passed on as sent: the pipeline converts the rows once the sizes are admitted.
    vectors = fields.Raw(required=True, metadata={
        "type": "array", "minItems": 1, "items": {"type": "array", "minItems": 1, "items": {"type": "number"}},
        "description": "N rows of D finite numbers (V, shape (N, D)); all rows the same length, no strings, "
                       "booleans, nulls, NaN or infinities, every value within `dtype`'s range. "
                       "N is at most BLOCKGRAD_MAX_N and D at most BLOCKGRAD_MAX_D (413 limit_exceeded; "
                       "this server's values are in the description at the top).",
        "example": [[0.5, -1.0], [2.0, 0.25], [1.5, 3.0]],
    })
    # `minimum` documented only: a factor is checked where N is known (the core's factor_refusal).
    factor = fields.Integer(strict=True, metadata={
        "minimum": 1, "description": "Split factor F, an integer with 1 <= F <= N (booleans, floats and strings are "
                                     "refused); the matrix is cut into F x F blocks, the last row and column of "
                                     "blocks taking the remainder. Default ceil(N / 6). The largest block (side x "
                                     "side x 2D numbers) must fit BLOCKGRAD_MAX_BLOCK_ELEMENTS (413 limit_exceeded; "
                                     "details.suggested_factor is the fastest factor that fits)."})
    objective = fields.String(load_default=DEFAULT_OBJECTIVE, validate=ObjectiveName(), metadata={
        "description": "Loss of one block B: sum = sum(B + offset), mean = mean(B), sum_of_squares = sum(B*B), "
                       "l2_norm = ||B||_2 (gradient 0 where the norm is 0), logsumexp = log(sum(exp(B))); "
                       "or the name of a model of this server (sum of its scores over the block's pairs). "
                       "GET /v1/objectives lists them all with their D and dtypes."})
    offset = JsonNumber(load_default=DEFAULT_OFFSET, metadata={
        "description": "Added to every entry by the `sum` objective (the classic i + 5 example); a finite number "
                       "within `dtype`'s range. Ignored by the other objectives."})
    outputs = fields.List(fields.String(validate=OneOf(OUTPUTS)), load_default=DEFAULT_OUTPUTS,
                          validate=Length(min=1), metadata={
        "description": "Which parts to return: a non-empty subset of blocks, accumulated, losses (repeats "
                       "are ignored). The answer's numbers (blocks N*N*2D, accumulated N*D, losses F*F) must "
                       "fit BLOCKGRAD_MAX_OUTPUT_ELEMENTS (413 limit_exceeded)."})
    dtype = fields.String(load_default=DEFAULT_DTYPE, validate=OneOf(DTYPES), metadata={
        "description": "Precision of all arithmetic and of every output number (written with the shortest "
                       "digits that round-trip in it)."})


# A misspelt field gets the valid names, not just "Unknown field.".
GradientRequestSchema.error_messages = {
    "unknown": f"Unknown field; the fields are {', '.join(GradientRequestSchema._declared_fields)}."}


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


def document_objectives(spec, objectives) -> None:
    """The OpenAPI `objective` as an enum of this server's objectives: the validator reads them
    per app, so apispec cannot see the names by itself."""
    spec.components.schemas[GradientRequestSchema.__name__.removesuffix("Schema")]["properties"]["objective"][
        "enum"] = list(objectives)
