"""The protocol's REST routes, under /v2, for the one model `blockgrad`.

Health answers are a status with an empty body (200 true, 400 false); failures
are the protocol's {"error": "<message>"} (ERROR_STYLE, registered for /v2).
"""
from flask import Response, current_app, request
from flask_smorest import Blueprint

from ...http.docs import OPEN_ROUTE, documents_errors
from ...http.errors import ErrorStyle
from ...http.pipeline import http_call, pipeline
from ..health import device_ready
from .codec import BINARY_CONTENT_TYPE
from .infer import decode, named_as_protocol, render
from .model import EXTENSIONS, MODEL_NAME, MODEL_VERSION, check_model, model_metadata
from .schemas import InferRequestSchema, InferResponseSchema, ModelMetadataSchema, ProtocolErrorSchema, ServerMetadataSchema

blp = Blueprint("v2", __name__, url_prefix="/v2",
                   description="Open Inference Protocol (KServe V2) with the binary tensor data extension.")

# The protocol's error body, and 400 for every invalid request (a 422 on /v1).
ERROR_STYLE = ErrorStyle(body=lambda error: {"error": error.message},
                         status=lambda status: 400 if status == 422 else status)

def path_parameter(name: str, value: str, description: str) -> dict:
    # One value each: other names are valid paths that answer 404, not schema-valid requests.
    return {"in": "path", "name": name, "required": True, "description": description,
            "schema": {"type": "string", "enum": [value]}}


MODEL = [path_parameter("model", MODEL_NAME, "The model's name.")]
VERSIONED = MODEL + [path_parameter("version", MODEL_VERSION, "The model's version.")]


def document_errors(*codes: str):
    """The table's codes, as /v2 answers them (the protocol's body, 400 for invalid requests)."""
    return documents_errors(blp, *codes, style=ERROR_STYLE, schema=ProtocolErrorSchema)


METADATA_ERRORS = ("unauthorized", "model_not_found", "internal_error")
INFER_ERRORS = ("bad_json", "validation_error", "non_finite_result", "unauthorized", "model_not_found",
                "too_large", "limit_exceeded", "unsupported_media_type", "deadline_exceeded",
                "device_out_of_memory", "read_timeout", "overloaded", "internal_error")


def health(ok: bool) -> Response:
    return Response(status=200 if ok else 400, mimetype="text/plain")  # the protocol's boolean: an empty body


@blp.route("", methods=["GET"])
@blp.alt_response(200, schema=ServerMetadataSchema, description="Server metadata.", success=True)
def server_metadata():
    """Server name, version and supported extensions."""
    return {"name": "blockgrad", "version": current_app.config["API_VERSION"], "extensions": list(EXTENSIONS)}


@blp.route("/health/live", methods=["GET"])
@blp.doc(**OPEN_ROUTE)
@blp.alt_response(200, description="Live (empty body).", success=True)
def server_live():
    """The server answers."""
    return health(True)


@blp.route("/health/ready", methods=["GET"])
@blp.doc(**OPEN_ROUTE)
@blp.alt_response(200, description="Ready (empty body).", success=True)
@blp.alt_response(400, description="Not ready: the compute device is not usable (empty body).")
def server_ready():
    """The model can run on the configured device."""
    return health(device_ready())


@blp.route("/models/<model>", methods=["GET"], parameters=MODEL)
@blp.route("/models/<model>/versions/<version>", methods=["GET"], parameters=VERSIONED)
@blp.alt_response(200, schema=ModelMetadataSchema, description="Model metadata; -1 marks a variable dimension.",
                  success=True)
@document_errors(*METADATA_ERRORS)
def get_model_metadata(model: str, version: str | None = None):
    """Inputs and outputs of the model: names, datatypes, shapes."""
    check_model(model, version)
    return model_metadata()


@blp.route("/models/<model>/ready", methods=["GET"], parameters=MODEL)
@blp.route("/models/<model>/versions/<version>/ready", methods=["GET"], parameters=VERSIONED)
@blp.alt_response(200, description="Ready (empty body).", success=True)
@blp.alt_response(400, description="Not ready (empty body).")
@document_errors(*METADATA_ERRORS)
def model_ready(model: str, version: str | None = None):
    """The model can run on the configured device."""
    check_model(model, version)
    return health(device_ready())


@blp.route("/models/<model>/infer", methods=["POST"], parameters=MODEL)
@blp.route("/models/<model>/versions/<version>/infer", methods=["POST"], parameters=VERSIONED)
@blp.alt_response(200, schema=InferResponseSchema, success=True, description=(
    "The outputs asked for (all by default). With binary outputs the body is "
    "application/octet-stream: the JSON header, its length in Inference-Header-Content-Length, "
    "then each binary output's bytes in order (little-endian, row-major). With JSON outputs only, "
    "the body is application/json, streamed (no Content-Length)."))
@blp.doc(requestBody={"required": True, "content": {
    "application/json": {"schema": InferRequestSchema},
    BINARY_CONTENT_TYPE: {"schema": {"type": "string", "format": "binary", "description": (
        "The JSON request, then each binary input's bytes; Inference-Header-Content-Length "
        "gives the JSON's length.")}}}})
@document_errors(*INFER_ERRORS)
def infer(model: str, version: str | None = None):
    """Per-block gradients as output tensors; JSON or binary tensor data both ways."""
    check_model(model, version)
    with named_as_protocol():
        return render(pipeline(decode(request), http_call()))
