"""GET /v1/objectives: the objectives this server has, built-ins and models."""
from flask_smorest import Blueprint
from marshmallow import Schema, fields

from ..core.objectives import describe
from ..http.docs import documents_errors
from ..extensions import services

blp = Blueprint("objectives", __name__, url_prefix="/v1",
                   description="The block objectives this server has: built-in formulas and the operator's models.")


class ObjectiveSchema(Schema):
    name = fields.String(required=True, metadata={"description": "The value of `objective` that selects it."})
    kind = fields.String(required=True, metadata={"enum": ["builtin", "model"],
                                                  "description": "A built-in formula, or a model of BLOCKGRAD_MODEL_DIR."})
    dim = fields.Integer(required=True, allow_none=True, metadata={
        "description": "The vector length D a model takes (its input is pairs of length 2D); null: any D."})
    dtypes = fields.List(fields.String(), required=True, metadata={
        "description": "The dtypes it computes in; a model only the one it was exported with."})
    description = fields.String(required=True, metadata={"description": "A built-in's formula of L(B); a model's "
                                                                       "file, size and parameter count."})
    file = fields.String(metadata={"description": "Models: the exported program's file name."})
    size_bytes = fields.Integer(metadata={"description": "Models: the file's size."})
    parameters = fields.Integer(metadata={"description": "Models: the number of parameters."})
    bytes_per_pair = fields.Integer(metadata={
        "description": "Models: estimated peak activation bytes per pair (3 x what autograd saves for "
                       "backward, measured at start-up); a block is charged pairs x bytes_per_pair against "
                       "BLOCKGRAD_MAX_ACTIVATION_BYTES, and the engine's chunks count it."})


class ObjectivesSchema(Schema):
    objectives = fields.List(fields.Nested(ObjectiveSchema), required=True, metadata={
        "description": "Built-ins first, then models by name."})


@blp.route("/objectives", methods=["GET"])
@blp.response(200, ObjectivesSchema)
@documents_errors(blp, "unauthorized", "internal_error")
def list_objectives():
    """The objectives `objective` may name, with the D and dtypes each takes."""
    return {"objectives": [describe(name, objective) for name, objective in services().objectives.items()]}
