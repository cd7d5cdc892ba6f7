"""Request parsing for flask-smorest views: orjson in, our error codes out.

flask-smorest validates with webargs; this parser swaps its JSON decoding for
orjson and turns its failures into ApiError (415, 400, 422) instead of aborts.
"""
import json

import orjson
from flask_smorest import Blueprint
from webargs.flaskparser import FlaskParser

from .errors import ApiError, validation_error


def is_json_mimetype(mimetype: str) -> bool:
    return mimetype == "application/json" or (mimetype.startswith("application/") and mimetype.endswith("+json"))


def reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def decode_json(body: bytes):
    """orjson, with one fallback: numbers beyond float64 (1e400) become inf, so
    validation can name the cell (422) instead of failing the whole body (400)."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        if "infinity when parsed" not in str(exc):
            raise ApiError(400, "bad_json", f"The body is not valid JSON: {exc}.") from None
    try:
        return json.loads(body, parse_constant=reject_constant)
    except ValueError as exc:
        raise ApiError(400, "bad_json", f"The body is not valid JSON: {exc}.") from None


class OrjsonParser(FlaskParser):
    def _raw_load_json(self, req):
        if not is_json_mimetype(req.mimetype):
            raise ApiError(415, "unsupported_media_type",
                           f"Send the body as Content-Type: application/json (got {req.mimetype or 'none'!r}).")
        return decode_json(req.get_data(cache=False))

    def handle_error(self, error, req, schema, *, error_status_code, error_headers):
        messages = error.messages.get("json", error.messages) if isinstance(error.messages, dict) else error.messages
        if not isinstance(messages, dict) or set(messages) == {"_schema"}:
            raise ApiError(422, "validation_error", "The body must be a JSON object with at least `vectors`.",
                           {"fields": {"_schema": messages.get("_schema", messages) if isinstance(messages, dict) else messages}})
        raise validation_error(messages)


class ApiBlueprint(Blueprint):
    ARGUMENTS_PARSER = OrjsonParser()
