"""Structured logs: one JSON object per line on stderr, and the request id.

The "blockgrad" logger (and its children, e.g. "blockgrad.request") gets one
stderr handler with `JsonFormatter`; records still propagate, so pytest's
caplog sees them. Request payloads are never logged: the per-request line holds
sizes and timings only.
"""
import logging
import re
import sys
import time
import uuid
from typing import Any

import orjson
from flask import g, has_request_context

REQUEST_ID_HEADER = "X-Request-ID"
# An incoming id is echoed into headers and logs, so only a short, plain token is kept.
SAFE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")

request_log = logging.getLogger("blockgrad.request")


def request_id_from(header: str | None) -> str:
    """The caller's id if it is a safe token, else a fresh uuid4 hex."""
    if header and SAFE_REQUEST_ID.fullmatch(header):
        return header
    return uuid.uuid4().hex


class RequestIdFilter(logging.Filter):
    """Stamp records logged during a request with its id, when they are made
    (a handler may format them later, outside the request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if has_request_context() and "request_id" in g:
            record.request_id = g.request_id
        return True


class JsonFormatter(logging.Formatter):
    """A record as one JSON line: time, level, logger, message, the request id,
    the record's `fields` (extra={"fields": {...}}) and any traceback."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": timestamp(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if hasattr(record, "request_id"):
            line["request_id"] = record.request_id
        line.update(getattr(record, "fields", {}))
        if record.exc_info:
            line["exc_info"] = self.formatException(record.exc_info)
        return orjson.dumps(line, default=str).decode()


class JsonStderrHandler(logging.StreamHandler):
    def __init__(self):
        super().__init__(sys.stderr)
        self.setFormatter(JsonFormatter())


def configure_logging(level: str) -> None:
    """Install the JSON stderr handler once per process (create_app may run many times)."""
    logger = logging.getLogger("blockgrad")
    logger.setLevel(level.upper())
    if not any(isinstance(handler, JsonStderrHandler) for handler in logger.handlers):
        logger.addHandler(JsonStderrHandler())
    if not any(isinstance(f, RequestIdFilter) for f in logger.filters):
        logger.addFilter(RequestIdFilter())  # records of "blockgrad" itself, e.g. tracebacks


def log_request(fields: dict[str, Any]) -> None:
    """The request's line: written straight to the JSON handler when it is the only place the
    record would go (as under gunicorn), the same line `logging` would write at a fraction of
    its cost per request; through `logging` whenever anything else listens (pytest's caplog,
    another handler, a filter)."""
    handler = sole_json_handler(request_log)
    if handler is None:
        request_log.info("request", extra={"fields": fields})
        return
    created = time.time()
    line = orjson.dumps({"ts": timestamp(created), "level": "info", "logger": request_log.name, "message": "request",
                         **fields}, default=str).decode() + handler.terminator
    with handler.lock:
        try:
            handler.stream.write(line)
            handler.flush()
        except Exception:  # noqa: BLE001 - as logging does: reported on stderr, never raised
            handler.handleError(request_log.makeRecord(request_log.name, logging.INFO, "", 0, "request", (), None))


def timestamp(created: float) -> str:
    """`created` (time.time()) as JsonFormatter writes a record's time, to the millisecond."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{int((created - int(created)) * 1000):03d}Z"


def sole_json_handler(logger: logging.Logger) -> "JsonStderrHandler | None":
    """The JsonStderrHandler an INFO record of `logger` would reach alone, unfiltered; else None."""
    if logger.disabled or logger.filters or not logger.isEnabledFor(logging.INFO):
        return None
    found = None
    current = logger
    while current is not None:
        for handler in current.handlers:
            if (found is not None or type(handler) is not JsonStderrHandler or handler.filters
                    or handler.level > logging.INFO or type(handler.formatter) is not JsonFormatter):
                return None
            found = handler
        if not current.propagate:
            break
        current = current.parent
    return found
