"""Request parsing for flask-smorest views: orjson in, our error codes out.

flask-smorest validates with webargs; this parser swaps its JSON decoding for
orjson and turns its failures into our errors (415, 400, 422) instead of aborts.
`read_body` is the one way a front end reads a request body (/v1 and /v2).
"""
import json
from typing import Any

import orjson
from flask import Request, g
from flask_smorest import Blueprint
from webargs.flaskparser import FlaskParser
from werkzeug.exceptions import RequestEntityTooLarge

from ..core.errors import validation_error
from ..core.memory import body_parse_bytes
from .connection import ReadAlarm
from .errors import BODY_STREAM_ERRORS, bad_json, body_unreadable, compressed_body, read_timeout, wrong_content_type
from .memory import reserve_for_request
from .settings import current_settings
from .slices import loads_sliced


def is_json_mimetype(mimetype: str) -> bool:
    return mimetype == "application/json" or (mimetype.startswith("application/") and mimetype.endswith("+json"))


def read_body(request: Request) -> bytes:
    """The whole body, uncompressed and within MAX_CONTENT_LENGTH, or an error (415, 413),
    within BLOCKGRAD_READ_TIMEOUT_S else 408 read_timeout (connection.ReadAlarm).

    A body with Content-Length over the limit is refused by werkzeug before reading.
    A chunked body has none: werkzeug then stops reading at the limit without a word,
    which would hand us a truncated document; one byte more from the server's stream
    tells a body exactly at the limit from a longer one.
    """
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        raise compressed_body(encoding)
    declared = request.content_length if request.content_length is not None else request.max_content_length
    if declared:  # reserved before reading: what the body may take until its sizes are known
        limit = request.max_content_length
        binary = request.mimetype in ("application/octet-stream", "application/x-npy")  # /v2, a .npy job
        reserve_for_request(body_parse_bytes(min(declared, limit) if limit else declared, binary=binary))
    seconds = current_settings().read_timeout_s
    with ReadAlarm(request.environ, seconds) as alarm:
        try:
            data = request.get_data(cache=False)
            limit = request.max_content_length
            more = (limit is not None and len(data) >= limit and request.content_length is None
                    and request.environ.get("wsgi.input_terminated") and request.environ["wsgi.input"].read(1))
        except Exception as exc:
            if alarm.fired:  # the read side was shut at the deadline: whatever broke, that is why
                raise read_timeout(seconds) from None
            if isinstance(exc, BODY_STREAM_ERRORS):  # gunicorn parses a chunked body as it is read
                raise body_unreadable(type(exc).__name__) from None
            raise
        if alarm.fired and (request.content_length or 0) > len(data):
            raise read_timeout(seconds)
    if more:
        raise RequestEntityTooLarge()
    g.body_bytes = len(data)  # for the memory prediction (app/core/memory.py)
    return data


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


class OrjsonParser(FlaskParser):
    def _raw_load_json(self, req):
        if not is_json_mimetype(req.mimetype):
            raise wrong_content_type(req.mimetype)
        body = read_body(req)
        document = loads_sliced(body)  # large bodies a slice at a time (slices.py)
        return document if document is not None else decode_json(body)

    def handle_error(self, error, req, schema, *, error_status_code, error_headers):
        messages = error.messages.get("json", error.messages) if isinstance(error.messages, dict) else error.messages
        if not isinstance(messages, dict) or set(messages) == {"_schema"}:
            raise validation_error({"_schema": messages.get("_schema", messages) if isinstance(messages, dict)
                                    else messages}, "The body must be a JSON object with at least `vectors`.")
        raise validation_error(messages)


class ApiBlueprint(Blueprint):
    ARGUMENTS_PARSER = OrjsonParser()
