"""Reading and decoding request bodies: orjson in, our error codes out (415, 400, 422).

`read_body` is the one way the pipeline reads a request body (/v1 and /v2); `decode_json`
and `decode_document` turn it into a document; `schema_error` is how a schema's refusal
reads.
"""
import json
from typing import Any

import orjson
from flask import Request, g
from flask_smorest import Blueprint
from marshmallow import ValidationError
from werkzeug.exceptions import RequestEntityTooLarge

from ..core.admission import body_parse_bytes, upload_bytes
from ..core.errors import BlockgradError, validation_error
from ..extensions import services
from .connection import ReadAlarm
from .errors import BODY_STREAM_ERRORS, bad_json, body_unreadable, compressed_body, incomplete_body, read_timeout
from .memory import hold_for_upload, reserve_for_body
from .slices import loads_sliced


def is_json_mimetype(mimetype: str) -> bool:
    return mimetype == "application/json" or (mimetype.startswith("application/") and mimetype.endswith("+json"))


def read_body(request: Request) -> bytes:
    """The whole body, uncompressed and within MAX_CONTENT_LENGTH, or an error (415, 413),
    within BLOCKGRAD_READ_TIMEOUT_S else 408 read_timeout (connection.ReadAlarm); a body that
    ends before its Content-Length is 400 bad_request.

    A body with Content-Length over the limit is refused by werkzeug before reading.
    Memory is held for what has arrived, never for what is declared (read_arriving); a
    Content-Length whose parse could never fit the budget is refused before reading.
    """
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        raise compressed_body(encoding)
    binary = request.mimetype in ("application/octet-stream", "application/x-npy")  # /v2, a .npy job
    declared = request.content_length
    limit = request.max_content_length
    if declared:  # the request's own size alone: what others hold plays no part
        services().ledger.check_budget(body_parse_bytes(min(declared, limit) if limit else declared, binary=binary))
    seconds = services().settings.read_timeout_s
    with ReadAlarm(request.environ, seconds) as alarm:
        try:
            data, more = read_arriving(request)
        except Exception as exc:
            if alarm.fired:  # the read side was shut at the deadline: whatever broke, that is why
                raise read_timeout(seconds) from None
            if isinstance(exc, BODY_STREAM_ERRORS):  # gunicorn parses a chunked body as it is read
                raise body_unreadable(type(exc).__name__) from None
            raise
        if alarm.fired and (declared or 0) > len(data):
            raise read_timeout(seconds)
    if more:
        raise RequestEntityTooLarge()
    if declared is not None and len(data) < declared:  # gunicorn hands a body cut by EOF over as it is
        raise incomplete_body(len(data), declared)
    reserve_for_body(body_parse_bytes(len(data), binary=binary))
    return data


# Read a body in pieces of this size (werkzeug's own step): a body that ends within its first
# piece is never an upload in progress, so it never meets BLOCKGRAD_UPLOAD_MEMORY_SHARE.
BODY_PIECE_BYTES = 64 * 1024


def read_arriving(request: Request) -> tuple[bytes, bool]:
    """The body, a piece at a time, and whether a chunked body goes on past the limit.

    After each whole piece with more to come, the request holds `upload_bytes` of what has
    arrived (memory.hold_for_upload); a short piece is the body's end (or the client's EOF).
    A chunked body has no Content-Length: werkzeug would stop at the limit without a word,
    handing over a truncated document; one byte more from the server's stream tells a body
    exactly at the limit from a longer one.
    """
    stream = request.stream
    declared = request.content_length
    limit = request.max_content_length
    end = declared if declared is not None else limit
    buffer = bytearray()
    while end is None or len(buffer) < end:
        step = BODY_PIECE_BYTES if end is None else min(BODY_PIECE_BYTES, end - len(buffer))
        piece = stream.read(step)
        buffer += piece
        if len(piece) < step:
            break
        if end is None or len(buffer) < end:
            hold_for_upload(upload_bytes(len(buffer)))
    more = (declared is None and limit is not None and len(buffer) >= limit
            and request.environ.get("wsgi.input_terminated") and request.environ["wsgi.input"].read(1))
    return bytes(buffer), bool(more)


def reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def decode_json(body: bytes):
    """orjson, with one fallback: numbers beyond float64 (1e400) become inf, so
    validation can name the cell (422) instead of failing the whole body (400)."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        if "infinity when parsed" not in str(exc):
            raise bad_json(str(exc)) from None
    try:
        document = json.loads(body, parse_constant=reject_constant)
    except ValueError as exc:
        raise bad_json(str(exc)) from None
    except RecursionError:  # the stdlib recurses per level; orjson stops at 1024 itself
        raise bad_json("nested too deeply") from None
    # The stdlib accepts lone surrogates (\ud800), which orjson refuses and which no
    # answer could echo back as UTF-8. Only an escape can make one: look only then.
    if b"\\u" in body and holds_lone_surrogate(document):
        raise bad_json("a string holds a lone UTF-16 surrogate")
    return document


def holds_lone_surrogate(document: Any) -> bool:
    """Whether any key or string in the parsed document cannot be encoded as UTF-8."""
    pending = [document]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(x for x in item if isinstance(x, (str, list, dict)))
    return False


def decode_document(body: bytes):
    """A JSON document; a large one parsed a slice at a time (slices.py)."""
    document = loads_sliced(body)
    return document if document is not None else decode_json(body)


def schema_error(error: ValidationError, message: str) -> BlockgradError:
    """A schema's refusal as validation_error; `message` for a body that is not an object at all."""
    messages = error.messages
    if not isinstance(messages, dict) or set(messages) == {"_schema"}:
        return validation_error({"_schema": messages.get("_schema", messages) if isinstance(messages, dict)
                                 else messages}, message)
    return validation_error(messages)


class ApiBlueprint(Blueprint):
    """Every route's blueprint: request bodies are read by the pipeline, never by webargs."""
