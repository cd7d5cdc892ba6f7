"""Recording and reporting a request: its id and timing, and when its answer is complete, one
metrics update and one JSON log line.

"Complete" means after the last body byte for a streamed answer (sending.WatchedBody watches
it), so its latency, outputs and compute time include the stream; for any other answer it is
right after the view. The pipeline describes a computing request by setting `g.work` (a
`RequestRecord`) and `g.device`; the error handler sets `g.error_code` (errors.py).

Logs: one JSON object per line on stderr. The "blockgrad" logger (and its children, e.g.
"blockgrad.request") gets one stderr handler with `JsonFormatter`; records still propagate, so
pytest's caplog sees them. Request payloads are never logged: the per-request line holds sizes
and timings only. Metrics: prometheus-client's, defined in metrics.py.

The client's socket is looked up here (`client_socket`), once as the request starts
(`g.client_socket`: the read alarm and the deadline's client-gone probe use it) and where the
answer's writes get their send timeout; a client_closed answer's drop uses it too.

`worker_timeout` is a code only the log line and the errors metric carry: gunicorn killed
the worker past its timeout, and its worker_abort hook calls `abort_in_flight` to log every
request still in flight with it, before the worker exits.
"""
import logging
import os
import re
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import orjson
from flask import Request, Response, current_app, g, has_request_context, request

import app.tracing as tracing
from ..core.admission import output_elements
from ..core.slots import GateListener
from ..extensions import KEY
from . import metrics
from .sending import PIECE_BYTES, WatchedBody

SOCKET_KEY = "gunicorn.socket"  # the client's socket, as gunicorn hands it to the app
REQUEST_ID_HEADER = "X-Request-ID"
# An incoming id is echoed into headers and logs, so only a short, plain token is kept.
SAFE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")
TRACED = ("/v1/", "/v2/models/")  # the routes traced, but for readiness: probes and /metrics are not

request_log = logging.getLogger("blockgrad.request")
tracing.DROPPED = metrics.TRACE_SPANS_DROPPED.inc  # a worker's dropped spans, in its own metrics file


def client_socket(environ: dict[str, Any]) -> socket.socket | None:
    """The client's socket (to time out a write, see it gone, shut it); None outside gunicorn."""
    sock = environ.get(SOCKET_KEY)
    return sock if isinstance(sock, socket.socket) else None


def drop_connection(environ: dict[str, Any]) -> None:
    """Shut both directions of the client's connection, so that nothing more reaches it: the
    server's next write fails (EPIPE), which servers take as the client gone, and they close."""
    sock = client_socket(environ)
    if sock is not None:
        with suppress(OSError):  # already gone
            sock.shutdown(socket.SHUT_RDWR)


def request_id_from(header: str | None) -> str:
    """The caller's id if it is a safe token, else a fresh uuid4 hex."""
    return header if header and SAFE_REQUEST_ID.fullmatch(header) else uuid.uuid4().hex


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
        line: dict[str, Any] = {"ts": timestamp(record.created), "level": record.levelname.lower(),
                                "logger": record.name, "message": record.getMessage()}
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
    found, current = None, logger
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


@dataclass
class RequestRecord:
    """What one computing request did, for its log line and metrics; the pipeline fills it."""
    n: int
    dim: int
    factor: int
    outputs: tuple[str, ...]  # as the front end names them (logged)
    computed: tuple[str, ...]  # the core's outputs they need (admission.output_elements counts their numbers)
    compute_s: float = 0.0

    def timed(self, blocks: Iterable) -> Iterator:
        """Yield from `blocks`, adding the time spent producing each item to compute_s."""
        iterator = iter(blocks)
        while True:
            start = time.perf_counter()
            try:
                item = next(iterator)
            except StopIteration:
                return
            finally:
                self.compute_s += time.perf_counter() - start
            yield item


WORKER_TIMEOUT = "worker_timeout"
# Logged for a request whose worker was killed before the app answered: gunicorn then
# writes its own 500 page (or closes the connection).
NO_ANSWER_STATUS = 500
# Requests of this worker not yet logged: key -> finish(code). gunicorn's worker_abort hook
# (another frame of the same process) logs them all as worker_timeout before the worker exits.
UNFINISHED: dict[int, Callable[[str | None], None]] = {}


def before_request() -> None:
    req, state = request._get_current_object(), g._get_current_object()  # one proxy lookup each
    state.client_socket = client_socket(req.environ)  # looked up once: the read alarm, the client-gone probe
    route = route_of(req)
    begin(state, request_id_from(req.headers.get(REQUEST_ID_HEADER)), route, req.method,
          req.headers if route.startswith(TRACED) and not route.endswith("/ready") else None)


def clock() -> tuple[float, float, int]:
    """Now, as a request's record counts it: (perf_counter, monotonic, time_ns)."""
    return time.perf_counter(), time.monotonic(), time.time_ns()


def begin(state, request_id: str, route: str, method: str, carrier=None, since: tuple | None = None) -> None:
    """A request starts: its record is `state` (Flask's `g`, or a gRPC call's own namespace).
    `carrier` (headers, gRPC metadata): the request is traced, as a child of its traceparent if any.
    `since`: when it arrived (`clock()`), if before now (a gRPC call, before its message)."""
    # The request's duration, its deadline (the pipeline's) and its span count from its arrival.
    state.started, state.arrived, start_ns = since or clock()
    state.cpu_started = (threading.get_ident(), time.thread_time())  # cpu_ms: this thread's CPU time
    state.request_id = request_id
    state.span = None if carrier is None or tracing.TRACER is None else tracing.RequestSpan(
        f"{method} {route}", carrier, start_ns, {"blockgrad.request_id": request_id})
    metrics.IN_FLIGHT.inc()
    state.in_flight = True
    key = state.unfinished_key = id(state)
    # Until the view answers: what the request knows when (and if) its worker is killed.
    UNFINISHED[key] = lambda code: finisher(NO_ANSWER_STATUS, state, route, method, answered=False)(code)


def after_request(response: Response) -> Response:
    state, req = g._get_current_object(), request._get_current_object()
    if "request_id" not in state:  # an earlier before_request hook refused the request
        state.request_id = request_id_from(req.headers.get(REQUEST_ID_HEADER))
    response.headers[REQUEST_ID_HEADER] = state.request_id
    send_timeout_s = current_app.extensions[KEY].settings.send_timeout_s
    sock = client_socket(req.environ)
    if sock is not None:  # from here on it only writes: each write may wait this long
        with suppress(OSError):
            sock.settimeout(send_timeout_s)
    finish = finisher(response.status_code, state, route_of(req), req.method)
    large = response.content_length is not None and response.content_length > PIECE_BYTES
    if (response.is_streamed or large) and not response.direct_passthrough:
        if "unfinished_key" in state:
            UNFINISHED[state.unfinished_key] = finish  # a kill while streaming: logged with the status sent
        # Finished when the body ends or the server closes it: after its last byte, when a
        # write fails, or without a byte at all (HEAD): PEP 3333 servers always call close().
        response.response = WatchedBody(response.response, finish, send_timeout_s)
    else:
        # Answered in full now, HEAD and 304 included; a file (the docs' assets, sent as it
        # is) needs no computing, so its request is complete too.
        finish(None)
    return response


def teardown_request(exc: BaseException | None) -> None:
    """A request whose after_request never ran (its hooks failed) is no longer in flight here."""
    state = g._get_current_object()
    if not state.get("finisher_made", False):
        UNFINISHED.pop(state.get("unfinished_key"), None)
        release_held(state)  # its memory reservation, which finish would have given back


def abort_in_flight(code: str = WORKER_TIMEOUT) -> None:
    """Log (and count) every request of this worker that has not finished, with `code`."""
    for finish in list(UNFINISHED.values()):
        finish(code)


def route_of(req: Request) -> str:
    rule = req.url_rule
    return rule.rule if rule else "unmatched"


def finisher(status: int | str, state, route: str, method: str,
             answered: bool = True) -> Callable[[str | None], None]:
    """Capture what the request knows now (from `state`, its `g`); the stream may end after its
    context is gone. The returned finish logs once: a later call (a worker killed while streaming,
    then its body closed) does nothing. `status`: HTTP's, or gRPC's name (OK, CANCELLED...)."""
    state.finisher_made = answered
    started = getattr(state, "started", time.perf_counter())
    cpu_started = getattr(state, "cpu_started", None)
    in_flight = getattr(state, "in_flight", False)
    request_id = getattr(state, "request_id", None) or request_id_from(None)
    work: RequestRecord | None = getattr(state, "work", None)
    device: str | None = getattr(state, "device", None)
    error_code: str | None = getattr(state, "error_code", None)
    key = getattr(state, "unfinished_key", None)
    span = getattr(state, "span", None)

    def finish(stream_error: str | None) -> None:
        """`stream_error`: the code of what cut a streamed body short, if anything did."""
        if getattr(state, "logged", False):
            return
        state.logged = True
        UNFINISHED.pop(key, None)
        release_held(state)
        complete = status in (200, "OK") and stream_error is None
        numbers = output_elements(work.n, work.dim, work.factor, work.computed) if work is not None and complete else 0
        duration_s = time.perf_counter() - started
        same_thread = cpu_started is not None and cpu_started[0] == threading.get_ident()  # not worker_abort's
        cpu_s = time.thread_time() - cpu_started[1] if same_thread else None
        code = stream_error or error_code
        observe_request(route, method, status, duration_s)
        if in_flight:
            metrics.IN_FLIGHT.dec()
        if code:
            observe_error(code)
        if device:
            observe_device(device)
        fields: dict[str, Any] = {"request_id": request_id, "method": method, "route": route,
                                  "status": status, "duration_ms": round(duration_s * 1000, 3)}
        if cpu_s is not None:
            fields["cpu_ms"] = round(cpu_s * 1000, 3)
        if work is not None:
            observe_work(numbers, work.compute_s)
            fields.update(n=work.n, dim=work.dim, factor=work.factor, outputs=list(work.outputs), output_numbers=numbers,
                          compute_ms=round(work.compute_s * 1000, 3))
        if code:
            fields["error"] = code
        if stream_error is not None and answered:
            fields["stream_aborted"] = True
        if span is not None:  # its ids in the log line
            span.end(getattr(state, "stages", None) or [], time.time_ns(), status, code)
            fields.update(trace_id=format(span.context.trace_id, "032x"), span_id=format(span.context.span_id, "016x"))
        log_request(fields)

    return finish


class MetricsListener(GateListener):
    """The compute gate's queue (app/core/slots.py) in the metrics: prometheus-client's own
    methods, called by the gate with no frame of ours between."""

    def __init__(self):
        self.waiting = metrics.QUEUE_DEPTH.set  # (depth)
        self.waited = metrics.QUEUE_WAIT.observe  # (seconds)
        self.shed = metrics.SHED.inc  # ()


def release_held(state) -> None:
    """Give back what the request whose `g` is `state` reserved, if anything (idempotent);
    `state` may outlive the request context (a stream's end)."""
    held = getattr(state, "memory_reservation", None)
    if held is not None:
        held.release()


# (route, method label, status) -> its REQUESTS and LATENCY children: labels() validates and
# locks on every call. The keys are as bounded as the labels.
REQUEST_CHILDREN: dict[tuple[str, str, int | str], tuple] = {}
DEVICES_SET: set[tuple[int, str]] = set()  # (pid, device): set to 1 by that process (a fork sets its own)


def observe_request(route: str, method: str, status: int | str, duration_s: float) -> None:
    key = (route, method if method in metrics.METHODS else "other", status)
    children = REQUEST_CHILDREN.get(key)
    if children is None:
        children = REQUEST_CHILDREN[key] = (metrics.REQUESTS.labels(route, key[1], str(status)), metrics.LATENCY.labels(route))
    children[0].inc()
    children[1].observe(duration_s)


def observe_work(output_numbers: int, compute_s: float) -> None:
    metrics.OUTPUT_NUMBERS.inc(output_numbers)
    metrics.COMPUTE_SECONDS.inc(compute_s)


def observe_error(code: str) -> None:
    metrics.ERRORS.labels(code).inc()


def observe_device(device: str) -> None:
    key = (os.getpid(), device)
    if key not in DEVICES_SET:  # a gauge that only ever reads 1: set once per process
        metrics.DEVICE.labels(device).set(1)
        DEVICES_SET.add(key)
