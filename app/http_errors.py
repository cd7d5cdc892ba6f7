"""One place that turns every failure into the JSON error object."""
import logging

import orjson
import torch
from flask import Flask, Response, g, has_request_context, request
from werkzeug.exceptions import HTTPException

from .device import device_out_of_memory
from .errors import ApiError

log = logging.getLogger("blockgrad")

HTTP_CODES = {
    400: "bad_request", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed",
    413: "too_large", 415: "unsupported_media_type", 500: "internal_error", 503: "unavailable",
}
INTERNAL_MESSAGE = "The server failed on this request; it has been logged."


def is_protocol_request() -> bool:
    """/v2 is the Open Inference Protocol: its errors are {"error": "<message>"}, and an
    invalid request is a 400 there (a 422 elsewhere)."""
    return has_request_context() and (request.path == "/v2" or request.path.startswith("/v2/"))


def error_response(error: ApiError) -> Response:
    body, status = error.body(), error.status
    if has_request_context():
        g.error_code = error.code  # for the errors metric and the log line (app/observe.py)
        if is_protocol_request():
            body, status = {"error": error.message}, 400 if error.status == 422 else error.status
    try:
        payload = orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS)
    except TypeError:  # orjson.JSONEncodeError too: a message or detail JSON cannot carry
        log.exception("error body for %s could not be serialised; answering a generic one", error.code)
        message = f"The request failed ({error.code}); the details could not be written as JSON."
        generic = {"error": message} if is_protocol_request() else {"error": {"code": error.code, "message": message}}
        payload = orjson.dumps(generic)
    response = Response(payload, status=status, mimetype="application/json")
    response.headers.update(error.headers)
    return response


def from_http_exception(exc: HTTPException) -> ApiError:
    status = exc.code or 500
    code = HTTP_CODES.get(status) or (exc.name or "error").lower().replace(" ", "_")
    message = exc.description or exc.name
    if status == 413:
        message = "The request body is over BLOCKGRAD_MAX_BODY_BYTES; send fewer or shorter vectors."
    elif status == 500:  # e.g. an error handler that failed: werkzeug's text says nothing more
        message = INTERNAL_MESSAGE
    valid_methods = getattr(exc, "valid_methods", None)
    headers = {"Allow": ", ".join(valid_methods)} if valid_methods else {}
    return ApiError(status, code, message, headers=headers)


def register_error_handlers(app: Flask) -> None:
    @app.errorhandler(ApiError)
    def handle_api_error(exc: ApiError):
        return error_response(exc)

    @app.errorhandler(torch.OutOfMemoryError)  # torch.cuda.OutOfMemoryError is the same class
    def handle_out_of_memory(exc: torch.OutOfMemoryError):
        log.warning("device out of memory: %s", exc)
        return handle_api_error(device_out_of_memory(exc))

    @app.errorhandler(HTTPException)
    def handle_http_exception(exc: HTTPException):
        return error_response(from_http_exception(exc))

    @app.errorhandler(Exception)
    def handle_unexpected(exc: Exception):
        log.exception("unhandled error")  # internals go to the log, never the body
        return error_response(ApiError(500, "internal_error", INTERNAL_MESSAGE))
