"""Parse a large /v1 body in slices, so that no single call holds the GIL for long.

orjson holds the GIL throughout a parse: a body near the size limit would stop every other
thread of the worker (probes included) for a noticeable time. A valid body's
`vectors` is an array of arrays of numbers, so its rows end at the first `]`: the array is
cut into slices of about SLICE_BYTES at row ends (`],`), each parsed on its own, and the
rest of the document is parsed with a placeholder in its place. Between two slices other
threads run.

Anything unexpected (a slice that does not parse, a placeholder not found where it was
put) returns None and the caller parses the whole body as before, so every error message
and edge case (1e400, duplicate keys, nested "vectors") stays that of the one-shot parse.
"""
import re
import secrets

import orjson

SLICE_BYTES = 1024 * 1024
SLICED_ABOVE = 4 * SLICE_BYTES  # smaller bodies parse at once, quickly enough
VECTORS_KEY = re.compile(rb'"vectors"\s*:\s*\[')
ROW_END = re.compile(rb'\]\s*,')
# A string no client can guess stands for the array while the rest is parsed.
PLACEHOLDER = secrets.token_hex(16)


def loads_sliced(body: bytes) -> dict | None:
    """The document, parsed a slice at a time; None when the one-shot parse must decide."""
    if len(body) <= SLICED_ABOVE:
        return None
    key = VECTORS_KEY.search(body)
    if key is None:
        return None
    start = key.end() - 1  # the outer "["
    rows: list = []
    pos = start + 1
    try:
        while True:
            cut = ROW_END.search(body, min(pos + SLICE_BYTES, len(body)))
            if cut is None:  # the last slice: up to the row that closes the array
                end = outer_end(body, pos)
                if end is None:
                    return None
                rows.extend(orjson.loads(b"[" + body[pos:end] + b"]"))
                pos = end + 1
                break
            rows.extend(orjson.loads(b"[" + body[pos:cut.start() + 1] + b"]"))  # other threads may run here
            pos = cut.end()
        rest = orjson.loads(body[:start] + b'"' + PLACEHOLDER.encode() + b'"' + body[pos:])
    except orjson.JSONDecodeError:
        return None
    if not isinstance(rest, dict) or rest.get("vectors") != PLACEHOLDER:
        return None
    rest["vectors"] = rows
    return rest


def outer_end(body: bytes, pos: int) -> int | None:
    """Index of the `]` closing the vectors array, from the last slice's start: the first
    `]` that follows a row's `]` (whitespace between)."""
    row_end = body.find(b"]", pos)
    while row_end != -1:
        after = row_end + 1
        while after < len(body) and body[after] in b" \t\r\n":
            after += 1
        if after < len(body) and body[after] == ord("]"):
            return after
        if after >= len(body) or body[after] != ord(","):
            return None
        row_end = body.find(b"]", after)
    return None
