"""The one error table: every code with its HTTP status, when it happens, its
documented headers and an example made by the constructor that raises it; and
the one handler that turns every failure into an error answer.

Front ends register how their errors look (`ErrorStyle`): /v1 and the service's
own routes answer {"error": {"code", "message", "details"}}; /v2 answers the
Open Inference Protocol's {"error": "<message>"}. Every error answer also
carries its code in the X-Blockgrad-Error-Code header.
"""
import logging
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice
from typing import Any

import orjson
from flask import Flask, Response, current_app, g, request
from gunicorn.http.errors import NoMoreData, ParseException
from werkzeug.exceptions import HTTPException

from ..core import errors as core
from ..core.errors import BlockgradError, cut_text
from ..extensions import services_of
from .record import drop_connection

log = logging.getLogger("blockgrad")

ERROR_CODE_HEADER = "X-Blockgrad-Error-Code"


class HttpError(BlockgradError):
    """An error only HTTP can have (a route, a method, a header), with its own response headers."""

    def __init__(self, code: str, message: str, details: dict[str, Any] | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(code, message, details)
        self.headers = headers or {}


# What gunicorn raises while the app reads a body it cannot parse (e.g. a bad chunk size).
BODY_STREAM_ERRORS = (ParseException, NoMoreData)


# Constructors of the HTTP-level errors (the core's are in app/core/errors.py).
def bad_request(message: str, details: dict[str, Any] | None = None) -> HttpError:
    return HttpError("bad_request", message, details)


def body_unreadable(kind: str) -> HttpError:
    """The body is not valid HTTP/1.1 framing; `kind` (the parser's exception name) says how,
    the bytes are not echoed."""
    return bad_request(f"The request body could not be read as HTTP/1.1 ({kind}); "
                       "send a valid chunked body or a Content-Length.")


def incomplete_body(received: int, declared: int) -> HttpError:
    """The client ended its side of the connection before its Content-Length was reached."""
    return HttpError("bad_request", f"The body ended after {received} of the {declared} bytes its Content-Length "
                                    "declares; send the whole body.", {"received": received, "declared": declared})


def bad_json(reason: str) -> HttpError:
    return HttpError("bad_json", f"The body is not valid JSON: {reason}.")


def unauthorized(message: str, challenge: str) -> HttpError:
    return HttpError("unauthorized", message, headers={"WWW-Authenticate": challenge})


def missing_token() -> HttpError:
    return unauthorized("This route needs the header `Authorization: Bearer <token>`.", 'Bearer realm="blockgrad"')


def invalid_token() -> HttpError:
    return unauthorized("The bearer token is not valid.", 'Bearer realm="blockgrad", error="invalid_token"')


def not_found(path: str, routes: list[str]) -> HttpError:
    """`routes`: what exists, as "METHOD /path" (service_routes())."""
    return HttpError("not_found", f"There is no route {path}; the routes are: {', '.join(routes)} "
                                  "(documented at /docs and /openapi.json).", {"routes": routes})


def model_not_found(message: str) -> HttpError:
    """/v2: no such model or version."""
    return HttpError("model_not_found", message)


def method_not_allowed(method: str, path: str, methods: list[str]) -> HttpError:
    """`methods`: what the route takes (the Allow header lists them all, HEAD and OPTIONS included)."""
    named = [m for m in methods if m not in ("HEAD", "OPTIONS")] or methods
    return HttpError("method_not_allowed", f"{path} does not take {method}; send {' or '.join(named)}.",
                     {"allowed": methods}, headers={"Allow": ", ".join(methods)} if methods else None)


def too_large(limit_bytes: int, limit: str = "BLOCKGRAD_MAX_BODY_BYTES", body: str = "request body") -> HttpError:
    """`limit`: the setting, BLOCKGRAD_MAX_BODY_BYTES or a .npy job body's BLOCKGRAD_MAX_JOB_BODY_BYTES."""
    return HttpError("too_large", f"The {body} is over {limit} = {limit_bytes} bytes; send fewer or shorter vectors.",
                     {"limit": limit, "allowed": limit_bytes})


def unsupported_media_type(message: str) -> HttpError:
    return HttpError("unsupported_media_type", message)


def wrong_content_type(got: str) -> HttpError:
    return unsupported_media_type(f"Send the body as Content-Type: application/json (got {got or 'none'!r}).")


def compressed_body(encoding: str) -> HttpError:
    return unsupported_media_type(f"Send the body uncompressed: Content-Encoding {encoding!r} is not supported.")


def read_timeout(seconds: float) -> HttpError:
    return HttpError("read_timeout", f"The request body did not arrive within BLOCKGRAD_READ_TIMEOUT_S = {seconds:g} s; "
                                     "send it faster, or through a proxy that buffers it.",
                     {"timeout_s": seconds})


def internal_error() -> HttpError:
    return HttpError("internal_error", "The server failed on this request; it has been logged.")


@dataclass(frozen=True)
class ErrorCode:
    status: int
    when: str
    example: Callable[[], BlockgradError]  # the constructor that raises it, with example arguments
    headers: tuple[str, ...] = ()  # response headers this code carries (documented in OpenAPI)


RETRY_AFTER = ("Retry-After",)
ERRORS: dict[str, ErrorCode] = {
    "bad_request": ErrorCode(400, "the body could not be read as HTTP/1.1 (a malformed chunked body), or it ended "
                                  "before its Content-Length (`details.received` and `details.declared` then give "
                                  "both in bytes); a malformed request line or header never reaches the app: "
                                  "gunicorn answers it itself with an HTML body (400, 414 for a request line over "
                                  "4094 bytes, 431 for a header over 8190 bytes or more than 100 headers, 417 for an "
                                  "Expect other than 100-continue)",
                             lambda: body_unreadable("InvalidChunkSize")),
    "bad_json": ErrorCode(400, "the body is not valid JSON (NaN and Infinity literals included)",
                          lambda: bad_json("unexpected character, expected a JSON value: line 1 column 1 (char 0)")),
    "unauthorized": ErrorCode(401, "BLOCKGRAD_API_TOKEN is set and the request lacks `Authorization: Bearer "
                                   "<token>` with the right token (probes and /metrics stay open); see "
                                   "WWW-Authenticate", missing_token, ("WWW-Authenticate",)),
    "not_found": ErrorCode(404, "no such route (any path not in this document); the message and "
                                "`details.routes` list the routes", lambda: not_found("/v1/gradient", [
                                    "POST /v1/gradients", "GET /healthz", "GET /docs"])),
    "model_not_found": ErrorCode(404, "/v2: no such model or version",
                                lambda: model_not_found("Unknown model 'other'; this server serves 'blockgrad'.")),
    "method_not_allowed": ErrorCode(405, "the path exists but not with this method; the message, "
                                         "`details.allowed` and the Allow header list the right ones",
                                    lambda: method_not_allowed("POST", "/healthz", ["GET", "HEAD", "OPTIONS"]),
                                    ("Allow",)),
    "too_large": ErrorCode(413, "the body is over BLOCKGRAD_MAX_BODY_BYTES; the message and `details.allowed` "
                                "give the limit in bytes", lambda: too_large(33554432)),
    "limit_exceeded": ErrorCode(413, "N, D, the largest block, a model's activations, the whole answer or the "
                                     "request's predicted peak memory (BLOCKGRAD_WORKER_MEMORY_BYTES) or time "
                                     "(BLOCKGRAD_REQUEST_TIMEOUT_S) is over its limit, or a body still arriving "
                                     "alone is over BLOCKGRAD_UPLOAD_MEMORY_SHARE of the memory; "
                                     "`details.limit` names it, the message says what to change",
                                lambda: core.too_many_vectors(8193, 8192)),
    "unsupported_media_type": ErrorCode(415, "Content-Type is not application/json, or the body is compressed",
                                        lambda: wrong_content_type("text/plain")),
    "validation_error": ErrorCode(422, "a field is missing, unknown or invalid; `details.fields` maps each to "
                                       "its messages",
                                  lambda: core.field_error("factor", "Must be between 1 and N = 3.")),
    "non_finite_result": ErrorCode(422, "a loss or gradient overflows dtype; `details.block` names the first block",
                                   lambda: core.non_finite_block(0, 1, "float32")),
    "internal_error": ErrorCode(500, "a bug; the body holds no internals, the log has the traceback "
                                     "(same request id)", internal_error),
    "deadline_exceeded": ErrorCode(503, "the request ran past BLOCKGRAD_REQUEST_TIMEOUT_S (see Retry-After)",
                                   lambda: core.deadline_exceeded(60.0), RETRY_AFTER),
    "device_out_of_memory": ErrorCode(503, "the GPU ran out of memory on this request; its memory was freed and "
                                           "the worker serves on (see Retry-After)",
                                      core.device_out_of_memory, RETRY_AFTER),
    "not_ready": ErrorCode(503, "the compute device is not usable",
                           lambda: core.not_ready("BLOCKGRAD_DEVICE=cuda but CUDA is not available in this process")),
    # The worker model's refusals.
    "read_timeout": ErrorCode(408, "a partial head did not arrive within BLOCKGRAD_HEADER_TIMEOUT_S, or head "
                                   "and body within BLOCKGRAD_READ_TIMEOUT_S; the connection is closed after the answer",
                              lambda: read_timeout(30.0)),
    "overloaded": ErrorCode(503, "the worker's compute slot is taken and BLOCKGRAD_QUEUE_DEPTH requests already "
                                 "wait for it, or the memory its requests hold plus this one's predicted peak "
                                 "is over BLOCKGRAD_WORKER_MEMORY_BYTES, or a body still arriving (over 64 KiB) "
                                 "would take the bodies still arriving past BLOCKGRAD_UPLOAD_MEMORY_SHARE of it "
                                 "(`details.limit` then names the setting): refused at once, retry after "
                                 "Retry-After (any replica)",
                            lambda: core.overloaded(4), RETRY_AFTER),
    # Jobs (docs/jobs.md).
    "job_not_found": ErrorCode(404, "/v1/jobs: no such job (unknown, deleted, or finished longer than "
                                    "BLOCKGRAD_JOB_TTL_S ago)", lambda: core.job_not_found("nope")),
    "job_not_done": ErrorCode(409, "/v1/jobs/{id}/result before the job succeeded; `details.status` says where it is "
                                   "(with Retry-After while queued or running)",
                              lambda: core.job_not_done("0" * 32, "running"), RETRY_AFTER),
    "job_done": ErrorCode(409, "POST /v1/jobs/{id}/cancel of a job that has finished (`details.status`: succeeded "
                               "or failed): nothing to cancel", lambda: core.job_done("0" * 32, "succeeded")),
    "idempotency_key_reused": ErrorCode(422, "POST /v1/jobs with an Idempotency-Key sent before with a different "
                                             "request (vectors or fields)", core.idempotency_key_reused),
    "store_unavailable": ErrorCode(503, "/v1/jobs: the job store (its database) did not answer within a few seconds "
                                        "(synchronous routes are unaffected; see Retry-After)",
                                   core.store_unavailable, RETRY_AFTER),
    "cluster_unavailable": ErrorCode(503, "/v1/jobs on a server without jobs (BLOCKGRAD_DASK_SCHEDULER=off)",
                                     core.no_cluster, RETRY_AFTER),
    "job_attempts_exhausted": ErrorCode(503, "never an answer's code: a failed job's `error.code` when its work on "
                                             "the cluster was lost BLOCKGRAD_JOB_ATTEMPTS times",
                                        lambda: core.job_attempts_exhausted(3)),
    "client_closed": ErrorCode(499, "never sent: the client closed (or half-closed) the connection before the "
                                    "answer was complete; the computation stopped and the connection is closed "
                                    "without a byte more (logged and counted under this code)",
                               core.client_closed),
}


def error_body(error: BlockgradError) -> dict[str, Any]:
    """`details` is always there, an object ({} when the code has nothing to add)."""
    return {"error": error.as_dict()}


def error_headers(error: BlockgradError) -> dict[str, str]:
    headers = {ERROR_CODE_HEADER: error.code, **getattr(error, "headers", {})}
    if error.retry_after_s is not None:
        headers["Retry-After"] = str(error.retry_after_s)
    return headers


@dataclass(frozen=True)
class ErrorStyle:
    """How a front end's errors look: the body for an error, and its status for the table's."""
    body: Callable[[BlockgradError], dict[str, Any]] = error_body
    status: Callable[[int], int] = lambda status: status


DEFAULT_STYLE = ErrorStyle()


def style_of_request() -> ErrorStyle:
    """The style registered for the request's path prefix, else the default (always in a request)."""
    path = request.path
    return next((style for prefix, style in services_of(current_app).error_styles.items()
                 if path == prefix or path.startswith(prefix + "/")), DEFAULT_STYLE)


def status_of(error: BlockgradError) -> int:
    entry = ERRORS.get(error.code)
    return entry.status if entry else getattr(error, "status", 500)


# Every error body fits in MAX_ERROR_BODY_BYTES whatever the request: messages, detail
# strings, maps and lists are cut (with a count of what was left out) before rendering,
# in time proportional to what is kept, not to what the request sent.
MAX_ERROR_BODY_BYTES = 16 * 1024
MAX_MESSAGE_CHARS = 2048
MAX_DETAIL_CHARS = 512
MAX_DETAIL_ITEMS = 24  # a list of this server's routes (20) fits whole
MAX_DETAIL_DEPTH = 4
TRUNCATED_KEY = "_truncated"  # in a cut map: how many entries were left out


def bounded(value: Any, depth: int = 0) -> Any:
    """`value` with every string, map and list cut to the limits above."""
    if isinstance(value, str):
        return cut_text(value, MAX_DETAIL_CHARS)
    if isinstance(value, dict):
        if depth >= MAX_DETAIL_DEPTH:
            return {TRUNCATED_KEY: len(value)} if value else {}
        kept = {cut_text(key) if isinstance(key, str) else key: bounded(item, depth + 1)
                for key, item in islice(value.items(), MAX_DETAIL_ITEMS)}
        if len(value) > MAX_DETAIL_ITEMS:
            kept[TRUNCATED_KEY] = len(value) - MAX_DETAIL_ITEMS
        return kept
    if isinstance(value, (list, tuple)):
        if depth >= MAX_DETAIL_DEPTH:
            return [f"... {len(value)} items"] if value else []
        kept = [bounded(item, depth + 1) for item in value[:MAX_DETAIL_ITEMS]]
        if len(value) > MAX_DETAIL_ITEMS:
            kept.append(f"... {len(value) - MAX_DETAIL_ITEMS} more")
        return kept
    return value


def bounded_error(error: BlockgradError) -> BlockgradError:
    """A copy of `error` (same code, status, headers) whose message and details fit the limits."""
    short = type(error).__new__(type(error))  # copy.copy would call __init__ with the wrong arguments
    short.__dict__.update(error.__dict__)
    short.message = cut_text(error.message, MAX_MESSAGE_CHARS)
    short.details = bounded(error.details)
    return short


def render_error_body(style: "ErrorStyle", error: BlockgradError) -> bytes:
    try:
        payload = orjson.dumps(style.body(bounded_error(error)), option=orjson.OPT_NON_STR_KEYS)
    except TypeError:  # orjson.JSONEncodeError too: a message or detail JSON cannot carry
        log.exception("error body for %s could not be serialised; answering a generic one", error.code)
        generic = BlockgradError(error.code, f"The request failed ({error.code}); the details could not be "
                                             "written as JSON.")
        return orjson.dumps(style.body(generic))
    if len(payload) > MAX_ERROR_BODY_BYTES:  # many long entries: the message alone, shorter
        payload = orjson.dumps(style.body(BlockgradError(error.code, cut_text(error.message, 1024))))
    return payload


def error_response(error: BlockgradError) -> Response:
    """Called by the error handlers only, so always in a request."""
    style = style_of_request()
    status = style.status(status_of(error))
    g.error_code = error.code  # for the errors metric and the log line (app/http/record.py)
    if error.code == "client_closed":
        drop_connection(request.environ)  # no status line reaches the wire; the log line still has the code
    response = Response(render_error_body(style, error), status=status, mimetype="application/json")
    response.headers.update(error_headers(error))
    return response


def service_routes(app: Flask) -> list[str]:
    """Every route as "METHOD /rule" (HEAD and OPTIONS left out), without static files and the docs' assets."""
    return [f"{method} {rule.rule}" for rule in app.url_map.iter_rules()
            if rule.endpoint != "static" and not rule.rule.startswith("/docs/")
            for method in sorted(rule.methods - {"HEAD", "OPTIONS"})]


def from_http_exception(exc: HTTPException) -> BlockgradError:
    status = exc.code or 500
    if status == 404:
        return not_found(request.path, service_routes(current_app))
    if status == 405:
        return method_not_allowed(request.method, request.path, sorted(getattr(exc, "valid_methods", None) or []))
    if status == 413:
        return too_large(current_app.config["MAX_CONTENT_LENGTH"])
    if status == 500:  # e.g. an error handler that failed: werkzeug's text says nothing more
        return internal_error()
    if status == 400:
        return bad_request(exc.description or exc.name)
    error = HttpError((exc.name or "error").lower().replace(" ", "_"), exc.description or exc.name)
    error.status = status  # a status outside the table
    return error


def register_error_handlers(app: Flask) -> None:
    app.register_error_handler(BlockgradError, error_response)
    app.register_error_handler(HTTPException, lambda exc: error_response(from_http_exception(exc)))

    @app.errorhandler(Exception)
    def handle_unexpected(exc: Exception):
        if isinstance(exc, BODY_STREAM_ERRORS):  # a body read outside read_body
            return error_response(body_unreadable(type(exc).__name__))
        log.exception("unhandled error")  # internals go to the log, never the body
        return error_response(internal_error())
