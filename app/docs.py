"""The OpenAPI document's prose and error catalogue, and the /docs page's assets.

flask-smorest builds the document from the marshmallow schemas and serves it at
/openapi.json, and renders Swagger UI at /docs (OPENAPI_SWAGGER_UI_* in
app/config.py). Swagger UI's files come from the pinned `swagger-ui-bundle`
package and are served here under /docs/assets/, so the page needs no internet.
"""
from collections.abc import Callable, Mapping

from flask import Blueprint, Flask, send_from_directory
from flask_smorest import Api
from swagger_ui_bundle import swagger_ui_path

from .schemas import ErrorSchema

# Every error code a documented route can answer: code -> (status, when, example message).
ERROR_CATALOGUE: dict[str, tuple[int, str, str]] = {
    "bad_json": (400, "the body is not valid JSON (NaN and Infinity literals included)",
                 "The body is not valid JSON: unexpected character: line 1 column 2 (char 1)."),
    "unauthorized": (401, "BLOCKGRAD_API_TOKEN is set and the request lacks `Authorization: Bearer <token>` "
                          "with the right token (probes and /metrics stay open); see WWW-Authenticate",
                     "This route needs the header `Authorization: Bearer <token>`."),
    "not_found": (404, "no such route (any path not in this document)",
                  "The requested URL was not found on the server."),
    "method_not_allowed": (405, "the path exists but not with this method; the Allow header lists the right ones",
                           "The method is not allowed for the requested URL."),
    "too_large": (413, "the body is over BLOCKGRAD_MAX_BODY_BYTES",
                  "The request body is over BLOCKGRAD_MAX_BODY_BYTES; send fewer or shorter vectors."),
    "limit_exceeded": (413, "N, D, the largest block or the whole answer is over its limit; "
                            "`details.limit` names it, the message says what to change",
                       "With factor 1 the largest block holds 8388608 numbers, over "
                       "BLOCKGRAD_MAX_BLOCK_ELEMENTS = 4194304; use a factor of at least 2."),
    "unsupported_media_type": (415, "Content-Type is not application/json",
                               "Send the body as Content-Type: application/json (got 'text/plain')."),
    "validation_error": (422, "a field is missing, unknown or invalid; `details.fields` maps each to its messages",
                         "The request is not valid; fix these fields: factor."),
    "non_finite_result": (422, "a loss or gradient overflows dtype; `details.block` names the first block",
                          "Block (row 0, col 1) has a loss or gradient that is not finite in float32; "
                          "send smaller values, another objective, or dtype float64."),
    "deadline_exceeded": (503, "the request ran past BLOCKGRAD_REQUEST_TIMEOUT_S (see Retry-After)",
                          "The request did not finish within 60 s; retry later, or send a larger factor "
                          "or fewer outputs."),
    "device_out_of_memory": (503, "the GPU ran out of memory on this request; its memory was freed "
                                  "and the worker serves on (see Retry-After)",
                             "The compute device ran out of memory; retry later, or send a larger factor "
                             "or fewer outputs."),
    "not_ready": (503, "the compute device is not usable",
                  "The compute device is not usable: BLOCKGRAD_DEVICE=cuda but CUDA is not available."),
    "internal_error": (500, "a bug; the body holds no internals, the log has the traceback (same request id)",
                       "The server failed on this request; it has been logged."),
}
EXAMPLE_DETAILS = {
    "limit_exceeded": {"limit": "BLOCKGRAD_MAX_BLOCK_ELEMENTS", "value": 8388608, "allowed": 4194304},
    "validation_error": {"fields": {"factor": ["Must be between 1 and N = 3."]}},
    "non_finite_result": {"block": {"row": 0, "col": 1}},
    "deadline_exceeded": {"timeout_s": 60.0},
}
ERROR_HEADERS = {
    "method_not_allowed": {"Allow": {"description": "The methods this path accepts.", "schema": {"type": "string"}}},
    "deadline_exceeded": {"Retry-After": {"description": "Seconds to wait before retrying.",
                                          "schema": {"type": "integer"}}},
    "device_out_of_memory": {"Retry-After": {"description": "Seconds to wait before retrying.",
                                             "schema": {"type": "integer"}}},
    "unauthorized": {"WWW-Authenticate": {"description": "The Bearer challenge.", "schema": {"type": "string"}}},
}


def error_example(code: str) -> dict:
    status, when, message = ERROR_CATALOGUE[code]
    error = {"code": code, "message": message}
    if code in EXAMPLE_DETAILS:
        error["details"] = EXAMPLE_DETAILS[code]
    return {"summary": f"{code}: {when}", "value": {"error": error}}


def error_responses_spec(*codes: str) -> dict[int, dict]:
    """Group `codes` by status: {status: {"description", "examples", "headers"}}."""
    by_status: dict[int, list[str]] = {}
    for code in codes:
        by_status.setdefault(ERROR_CATALOGUE[code][0], []).append(code)
    return {status: {"description": "; ".join(f"`{code}`: {ERROR_CATALOGUE[code][1]}" for code in group),
                     "examples": {code: error_example(code) for code in group},
                     "headers": {name: header for code in group for name, header in ERROR_HEADERS.get(code, {}).items()}}
            for status, group in by_status.items()}


def documents_errors(blp, *codes: str) -> Callable:
    """Decorator: one documented error response (ErrorSchema, examples) per status of `codes`."""
    def decorate(view):
        for status, spec in error_responses_spec(*codes).items():
            view = blp.alt_response(status, schema=ErrorSchema, **{k: v for k, v in spec.items() if v})(view)
        return view
    return decorate


def api_description(config: Mapping) -> str:
    """The document's info.description: limits as configured, errors, headers, other endpoints."""
    limits = [
        ("BLOCKGRAD_MAX_BODY_BYTES", "largest request body, in bytes (413 too_large)"),
        ("BLOCKGRAD_MAX_N", "most vectors N (413 limit_exceeded)"),
        ("BLOCKGRAD_MAX_D", "longest vector D (413 limit_exceeded)"),
        ("BLOCKGRAD_MAX_BLOCK_ELEMENTS", "most numbers in one block, side x side x 2D (413 limit_exceeded)"),
        ("BLOCKGRAD_MAX_OUTPUT_ELEMENTS", "most numbers in one answer: blocks `N*N*2D` + accumulated `N*D` "
                                          "+ losses `F*F` (413 limit_exceeded)"),
        ("BLOCKGRAD_REQUEST_TIMEOUT_S", "seconds a request may compute (503 deadline_exceeded)"),
    ]
    rows = "\n".join(f"| `{name}` | {config[name]} | {meaning} |" for name, meaning in limits)
    codes = "\n".join(f"| {status} | `{code}` | {when} |" for code, (status, when, _) in ERROR_CATALOGUE.items())
    return f"""Per-block gradients of the pairwise feature matrix built from N vectors of length D.

## Limits of this server
| setting | value | what it limits |
|---|---|---|
{rows}

## Errors
Every error, on every path but `/v2`, is `{{"error": {{"code", "message", "details"}}}}` (schema `Error`);
the Open Inference Protocol's `/v2` paths answer its own `{{"error": "<message>"}}`, with 400 for any
invalid request:
| status | code | when |
|---|---|---|
{codes}

404 `not_found` answers any path not listed here, and 405 `method_not_allowed` any listed path
called with a method it does not list.

## Request ids
Every response carries `X-Request-ID`: the request's own header when it is 1-128 characters of
`A-Z a-z 0-9 . _ : / + = -`, else a fresh 32-digit hex id. The same id is in the request's log line.
"""


BEARER_SCHEME = "bearerAuth"
OPEN_ROUTE = {"security": []}  # blp.doc(**OPEN_ROUTE): probes and metrics never need the token


def spec_options(config: Mapping) -> dict:
    """API_SPEC_OPTIONS: the description, and the bearer requirement when a token is set."""
    options = {"info": {"description": api_description(config)}}
    if (config.get("BLOCKGRAD_API_TOKEN") or "").strip():
        options["security"] = [{BEARER_SCHEME: []}]
    return options


def register_docs(app: Flask, api: Api) -> None:
    """Serve Swagger UI's files under /docs/assets/ and describe /openapi.json and /docs."""
    api.spec.components.security_scheme(BEARER_SCHEME, {
        "type": "http", "scheme": "bearer",
        "description": "Required on every route but the probes and /metrics when BLOCKGRAD_API_TOKEN is set."})
    assets = Blueprint("docs_assets", __name__)

    @assets.route("/docs/assets/<path:filename>")
    def docs_asset(filename: str):
        return send_from_directory(swagger_ui_path, filename, max_age=86400)

    app.register_blueprint(assets)
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    internal_error = dict(error, description=f"`internal_error`: {ERROR_CATALOGUE['internal_error'][1]}")
    api.spec.tag({"name": "docs", "description": "This document and its interactive page."})
    rules = {rule.rule: rule for rule in app.url_map.iter_rules()}  # flask-smorest documents a path by its rule
    api.spec.path(rule=rules["/openapi.json"], operations={"get": {
        "tags": ["docs"], "summary": "This OpenAPI 3 document.",
        "responses": {"200": {"description": "The document.",
                              "content": {"application/json": {"schema": {"type": "object"}}}},
                      "500": internal_error}}})
    api.spec.path(rule=rules["/docs"], operations={"get": {
        "tags": ["docs"], "summary": "Interactive documentation (Swagger UI, served locally).",
        "responses": {"200": {"description": "An HTML page; its scripts and styles are under /docs/assets/.",
                              "content": {"text/html": {"schema": {"type": "string"}}}},
                      "500": internal_error}}})
