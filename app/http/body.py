"""Reading a request's body: from the client's socket, within its time and memory, to a document.

- the socket (`g.client_socket`, set by record.py; outside gunicorn there is none and these do
  nothing): `client_gone` peeks for end-of-file, so that a computation stops when its client
  leaves (the request's Deadline asks it); `ReadAlarm` bounds the whole body by
  BLOCKGRAD_READ_TIMEOUT_S (a socket timeout bounds one recv, not a body sent a byte at a time,
  so one watchdog thread per process shuts the read side at the deadline);
- the memory: one reservation per request in the worker's ledger, grown with its body as it
  arrives (within the uploads' share while it is still arriving), resized to the request's
  predicted peak once admitted, released when its answer has been written (record.py);
- the parse: orjson, a large /v1 body a slice at a time (`loads_sliced`), our error codes
  out (415, 400, 413, 408).
"""
import heapq
import itertools
import json
import math
import os
import re
import secrets
import select
import socket
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from typing import Any

import orjson
from flask import Request, current_app, g
from werkzeug.exceptions import RequestEntityTooLarge

from ..core.admission import MemoryLedger, body_parse_bytes, upload_bytes
from ..core.host import CONN_STARTED_KEY
from ..extensions import KEY
from .errors import BODY_STREAM_ERRORS, bad_json, body_unreadable, compressed_body, incomplete_body, read_timeout


def client_gone(sock: socket.socket) -> bool:
    """Whether the peer has closed (EOF) or reset the connection; never blocks.

    Data waiting (a pipelined next request) means the client is still there. A client
    that half-closes after sending its request counts as gone, as for nginx.
    """
    try:
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN | select.POLLHUP | select.POLLERR)
        if not poller.poll(0):
            return False
        return sock.recv(1, socket.MSG_PEEK) == b""  # readable: recv returns at once
    except (BlockingIOError, InterruptedError):
        return False
    except (OSError, ValueError):  # reset, or already closed
        return True


class Alarm:
    def __init__(self, due: float, action: Callable[[], None]):
        self.due, self.action = due, action
        self.cancelled = self.fired = False


class Watchdog:
    """One daemon thread per process running each armed action at its time, unless cancelled.

    Nearly every alarm is cancelled soon after it is armed (the body has arrived): a
    cancelled alarm at the front of the heap is dropped at once, and the thread is woken
    only for an alarm due before the one it sleeps for, so that a request costs the thread
    no wake-up (each would take the GIL from the requests' threads)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Alarm]] = []
        self._order = itertools.count()
        self._pid: int | None = None
        self._wakes_at = -math.inf  # when the thread's wait ends; -inf: it is not waiting, it will look

    def arm(self, seconds: float, action: Callable[[], None]) -> Alarm:
        alarm = Alarm(time.monotonic() + seconds, action)
        with self._cond:
            if self._pid != os.getpid():  # first use in this (forked) process
                self._pid, self._heap, self._wakes_at = os.getpid(), [], -math.inf
                threading.Thread(target=self._run, name="blockgrad-watchdog", daemon=True).start()
            heapq.heappush(self._heap, (alarm.due, next(self._order), alarm))
            if alarm.due < self._wakes_at:  # due before the thread would look again: wake it
                self._cond.notify()
        return alarm

    def cancel(self, alarm: Alarm) -> None:
        with self._cond:
            alarm.cancelled = True
            self._drop_cancelled()

    def pending(self) -> int:
        """Alarms still in the heap (cancelled ones behind a live one included)."""
        with self._cond:
            return len(self._heap)

    def _drop_cancelled(self) -> None:
        while self._heap and self._heap[0][2].cancelled:
            heapq.heappop(self._heap)

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    self._drop_cancelled()
                    now = time.monotonic()
                    if self._heap and self._heap[0][0] <= now:
                        break
                    self._wakes_at = self._heap[0][0] if self._heap else math.inf
                    self._cond.wait(None if not self._heap else self._wakes_at - now)
                self._wakes_at = -math.inf
                _, _, alarm = heapq.heappop(self._heap)
                alarm.fired = True
            with suppress(Exception):  # a watchdog must outlive any one action
                alarm.action()


WATCHDOG = Watchdog()


def shut_reading(sock: socket.socket) -> Callable[[], None]:
    def action() -> None:
        with suppress(OSError):
            sock.shutdown(socket.SHUT_RD)  # a blocked recv returns b"" at once; writing still works
    return action


class ReadAlarm:
    """`with ReadAlarm(sock, seconds, started) as alarm:` read the body; `alarm.fired` if it took
    too long (`seconds` from `started`, when given; no alarm without a socket)."""

    def __init__(self, sock: socket.socket | None, seconds: float, started: float | None):
        self.sock = sock
        self.seconds = seconds if started is None else max(0.0, started + seconds - time.monotonic())
        self.alarm: Alarm | None = None

    @property
    def fired(self) -> bool:
        return self.alarm is not None and self.alarm.fired

    def __enter__(self) -> "ReadAlarm":
        if self.sock is not None:
            self.alarm = WATCHDOG.arm(self.seconds, shut_reading(self.sock))
        return self

    def __exit__(self, *exc) -> None:
        if self.alarm is not None:
            WATCHDOG.cancel(self.alarm)


def reserve_for_request(ledger: MemoryLedger, nbytes: int, upload: bool = False, state: Any = None) -> None:
    """Hold `nbytes` for this request (replacing what it held): limit_exceeded (413) over the
    budget alone, overloaded (503, Retry-After) when only the other requests are in the way.
    `upload`: a body with more to come, held within the uploads' share too; without it, the
    body has arrived and the reservation counts against the budget only. `state`: where the
    request keeps it (default Flask's `g`)."""
    state = g if state is None else state
    held = getattr(state, "memory_reservation", None)
    if held is None:
        state.memory_reservation = ledger.reserve(nbytes, uploading=upload)
        return
    if not upload:
        held.settle()
    held.resize(nbytes)


SLICE_BYTES = 1024 * 1024
SLICED_ABOVE = 4 * SLICE_BYTES  # smaller bodies parse at once, quickly enough
VECTORS_KEY = re.compile(rb'"vectors"\s*:\s*\[')
ROW_END = re.compile(rb'\]\s*,')
ROW_FOLLOWER = re.compile(rb"\][ \t\r\n]*(.?)", re.S)  # a row's `]` and what follows it
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
    for row_end in ROW_FOLLOWER.finditer(body, pos):
        follower = row_end.group(1)
        if follower != b",":  # after a comma another row follows: look on
            return row_end.start(1) if follower == b"]" else None
    return None


def is_json_mimetype(mimetype: str) -> bool:
    return mimetype == "application/json" or (mimetype.startswith("application/") and mimetype.endswith("+json"))


def read_body(request: Request) -> bytes:
    """The whole body, uncompressed and within MAX_CONTENT_LENGTH, or an error (415, 413),
    within BLOCKGRAD_READ_TIMEOUT_S else 408 read_timeout (ReadAlarm); a body that
    ends before its Content-Length is 400 bad_request.

    A body with Content-Length over the limit is refused by werkzeug before reading.
    Memory is held for what has arrived, never for what is declared (read_arriving); a
    Content-Length whose parse could never fit the budget is refused before reading.
    """
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        raise compressed_body(encoding)
    binary = request.mimetype in ("application/octet-stream", "application/x-npy")  # /v2, a .npy job
    declared, limit = request.content_length, request.max_content_length
    served = current_app.extensions[KEY]
    ledger = served.ledger
    parse_bytes = body_parse_bytes(min(declared, limit) if limit else declared, binary=binary) if declared else None
    if parse_bytes is not None:  # the request's own size alone: what others hold plays no part
        ledger.check_budget(parse_bytes)
    seconds = served.settings.read_timeout_s
    with ReadAlarm(g.get("client_socket"), seconds, request.environ.get(CONN_STARTED_KEY)) as alarm:
        try:
            data, more = read_arriving(request, ledger)
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
    if parse_bytes is None or len(data) != declared:  # else what was checked above
        parse_bytes = body_parse_bytes(len(data), binary=binary)
    reserve_for_request(ledger, parse_bytes)  # what parsing it may take
    return data


# Read a body in pieces of this size (werkzeug's own step): a body that ends within its first
# piece is never an upload in progress, so it never meets BLOCKGRAD_UPLOAD_MEMORY_SHARE.
BODY_PIECE_BYTES = 64 * 1024


def read_arriving(request: Request, ledger: MemoryLedger) -> tuple[bytes, bool]:
    """The body, a piece at a time, and whether a chunked body goes on past the limit.

    After each whole piece with more to come, the request holds `upload_bytes` of what has
    arrived (reserve_for_request, as an upload); a short piece is the body's end (or the client's EOF).
    A chunked body has no Content-Length: werkzeug would stop at the limit without a word,
    handing over a truncated document; one byte more from the server's stream tells a body
    exactly at the limit from a longer one.
    """
    stream = request.stream
    declared, limit = request.content_length, request.max_content_length
    end = declared if declared is not None else limit
    buffer = bytearray()
    while end is None or len(buffer) < end:
        step = BODY_PIECE_BYTES if end is None else min(BODY_PIECE_BYTES, end - len(buffer))
        piece = stream.read(step)
        buffer += piece
        if len(piece) < step:
            break
        if end is None or len(buffer) < end:
            reserve_for_request(ledger, upload_bytes(len(buffer)), upload=True)
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
    """A JSON document; a large one parsed a slice at a time (loads_sliced)."""
    document = loads_sliced(body)
    return document if document is not None else decode_json(body)
