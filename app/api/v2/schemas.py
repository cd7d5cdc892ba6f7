"""The protocol's JSON documents as marshmallow schemas.

The request schemas check the envelope's structure (names, types, shapes) and
the model's parameters' JSON types; the core's `build_request` then applies the
rules that need the numbers. The response schemas document the routes.
"""
from marshmallow import Schema, fields
from marshmallow.validate import Length, Range

from ..fields import JsonNumber, ObjectiveName

Parameters = fields.Dict  # $parameters: {name: $string | $number | $boolean}


class RequestInputSchema(Schema):
    name = fields.String(required=True)
    shape = fields.List(fields.Integer(strict=True, validate=Range(min=0)), required=True)
    datatype = fields.String(required=True)
    parameters = Parameters(keys=fields.String(), load_default=dict)
    data = fields.Raw(metadata={
        "type": "array", "items": {"anyOf": [{"type": "number"}, {"type": "array"}]},  # never null
        "description": "Row-major numbers, flat or nested; absent when binary."})


class ParametersSchema(Schema):
    """The model's parameters (factor, objective, offset): JSON types as /v1 takes them."""
    factor = fields.Integer(strict=True, metadata={"minimum": 1})  # documented only: build_request checks it
    objective = fields.String(validate=ObjectiveName())
    offset = JsonNumber()


class RequestOutputSchema(Schema):
    name = fields.String(required=True)
    parameters = Parameters(keys=fields.String(), load_default=dict)


# Swagger UI's "Try it out" sends these: a 4 x 2 FP32 input, two JSON outputs.
EXAMPLE_INPUTS = [{"name": "vectors", "datatype": "FP32", "shape": [4, 2], "data": [0, 1, 2, 3, 4, 5, 6, 7]}]
EXAMPLE_OUTPUTS = [{"name": "accumulated"}, {"name": "losses"}]


class InferRequestSchema(Schema):
    id = fields.String(metadata={"example": "example-1"})
    parameters = Parameters(keys=fields.String(), load_default=dict, metadata={
        "description": "factor (integer), objective (string), offset (number): as in /v1/gradients; "
                       "binary_data_output (boolean): every output as binary data.",
        "example": {"factor": 2}})
    inputs = fields.List(fields.Nested(RequestInputSchema), required=True, validate=Length(min=1),
                         metadata={"example": EXAMPLE_INPUTS})
    outputs = fields.List(fields.Nested(RequestOutputSchema), validate=Length(min=1),
                          metadata={"example": EXAMPLE_OUTPUTS})
    # Some clients repeat the URL's model in the body (the extension's own examples do).
    model_name = fields.String(metadata={"example": "blockgrad"})
    model_version = fields.String(metadata={"example": "1"})


class MetadataTensorSchema(Schema):
    name = fields.String()
    datatype = fields.String(metadata={"description": "The default datatype (the protocol's one)."})
    datatypes = fields.List(fields.String(), metadata={
        "description": "Every datatype taken: FP32 or FP64 for the input; the float outputs take the input's."})
    shape = fields.List(fields.Integer(), metadata={"description": "-1 marks a variable dimension."})


class ServerMetadataSchema(Schema):
    name = fields.String()
    version = fields.String()
    extensions = fields.List(fields.String())


class ModelMetadataSchema(Schema):
    name = fields.String()
    versions = fields.List(fields.String())
    platform = fields.String()
    inputs = fields.List(fields.Nested(MetadataTensorSchema))
    outputs = fields.List(fields.Nested(MetadataTensorSchema))


class ResponseOutputSchema(Schema):
    name = fields.String()
    shape = fields.List(fields.Integer())
    datatype = fields.String()
    parameters = Parameters(metadata={"description": "binary_data_size when the data follows the JSON as bytes."})
    data = fields.List(fields.Raw(), metadata={"description": "Flat, row-major; absent when binary."})


class InferResponseSchema(Schema):
    model_name = fields.String()
    model_version = fields.String()
    id = fields.String()
    parameters = Parameters(metadata={"description": "factor, objective, offset and device as used."})
    outputs = fields.List(fields.Nested(ResponseOutputSchema))


class ProtocolErrorSchema(Schema):
    error = fields.String(metadata={"description": "What went wrong and what to change."})


def document_objectives(spec, objectives) -> None:
    """The names `objective` takes, in the parameters' description (read per app, see /v1's)."""
    parameters = spec.components.schemas[InferRequestSchema.__name__.removesuffix("Schema")]["properties"]["parameters"]
    parameters["description"] += f" objective is one of: {', '.join(objectives)}."
