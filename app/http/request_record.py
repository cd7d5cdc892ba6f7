"""Per-request bookkeeping: request id, timing, and when the answer is complete, one
metrics update (metrics.py) and one JSON log line (request_log.py).

"Complete" means after the last body byte for a streamed answer (cut_short.py watches it),
so its latency, outputs and compute time include the stream; for any other answer it is
right after the view. The pipeline describes a computing request by setting `g.work` (a
`RequestRecord`) and `g.device`; the error handler sets `g.error_code` (errors.py).

`worker_timeout` is a code only the log line and the errors metric carry: gunicorn killed
the worker past its timeout, and its worker_abort hook calls `abort_in_flight` to log every
request still in flight with it, before the worker exits.
"""
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from flask import Flask, Request, Response, g, request

from ..core.admission import output_elements
from ..extensions import services
from . import metrics
from .cut_short import WatchedBody
from .memory import release_held
from .request_log import REQUEST_ID_HEADER, log_request, request_id_from
from .sending import PIECE_BYTES, start_sending


@dataclass
class RequestRecord:
    """What one computing request did, for its log line and metrics; the pipeline fills it."""
    n: int
    dim: int
    factor: int
    outputs: tuple[str, ...]
    output_numbers: int  # numbers in the full answer (see admission.output_elements)
    compute_s: float = 0.0

    @classmethod
    def of(cls, n: int, dim: int, factor: int, outputs: tuple[str, ...],
           computed: tuple[str, ...] | None = None) -> "RequestRecord":
        """`outputs` as logged; `computed` (default the same): the core's outputs they need."""
        return cls(n, dim, factor, outputs, output_elements(n, dim, factor, outputs if computed is None else computed))

    @contextmanager
    def computing(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.compute_s += time.perf_counter() - start

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
    state, req = g._get_current_object(), request._get_current_object()  # one proxy lookup each
    state.started = time.perf_counter()
    state.cpu_started = (threading.get_ident(), time.thread_time())  # cpu_ms: this thread's CPU time
    state.arrived = time.monotonic()  # the request's deadline counts from here (pipeline.request_deadline)
    state.request_id = request_id_from(req.headers.get(REQUEST_ID_HEADER))
    metrics.IN_FLIGHT.inc()
    state.in_flight = True
    key = state.unfinished_key = id(state)
    route, method = route_of(req), req.method
    # Until the view answers: what the request knows when (and if) its worker is killed.
    UNFINISHED[key] = lambda code: finisher(NO_ANSWER_STATUS, state, route, method, answered=False)(code)


def after_request(response: Response) -> Response:
    state, req = g._get_current_object(), request._get_current_object()
    if "request_id" not in state:  # an earlier before_request hook refused the request
        state.request_id = request_id_from(req.headers.get(REQUEST_ID_HEADER))
    response.headers[REQUEST_ID_HEADER] = state.request_id
    send_timeout_s = services().settings.send_timeout_s
    start_sending(req.environ, send_timeout_s)
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


def finisher(status: int, state, route: str, method: str, answered: bool = True) -> Callable[[str | None], None]:
    """Capture what the request knows now (from `state`, its `g`); the stream may end after its
    context is gone. The returned finish logs once: a later call (a worker killed while streaming,
    then its body closed) does nothing."""
    state.finisher_made = answered
    started = getattr(state, "started", time.perf_counter())
    cpu_started = getattr(state, "cpu_started", None)
    in_flight = getattr(state, "in_flight", False)
    request_id = getattr(state, "request_id", None) or request_id_from(None)
    work: RequestRecord | None = getattr(state, "work", None)
    device: str | None = getattr(state, "device", None)
    error_code: str | None = getattr(state, "error_code", None)
    key = getattr(state, "unfinished_key", None)

    def finish(stream_error: str | None) -> None:
        """`stream_error`: the code of what cut a streamed body short, if anything did."""
        if getattr(state, "logged", False):
            return
        state.logged = True
        UNFINISHED.pop(key, None)
        release_held(state)
        duration_s = time.perf_counter() - started
        same_thread = cpu_started is not None and cpu_started[0] == threading.get_ident()  # not worker_abort's
        cpu_s = time.thread_time() - cpu_started[1] if same_thread else None
        code = stream_error or error_code
        metrics.observe_request(route, method, status, duration_s)
        if in_flight:
            metrics.IN_FLIGHT.dec()
        if code:
            metrics.observe_error(code)
        if device:
            metrics.observe_device(device)
        fields: dict[str, Any] = {"request_id": request_id, "method": method, "route": route,
                                  "status": status, "duration_ms": round(duration_s * 1000, 3)}
        if cpu_s is not None:
            fields["cpu_ms"] = round(cpu_s * 1000, 3)
        if work is not None:
            complete = status == 200 and stream_error is None
            metrics.observe_work(work.output_numbers if complete else 0, work.compute_s)
            fields.update(n=work.n, dim=work.dim, factor=work.factor, outputs=list(work.outputs),
                          output_numbers=work.output_numbers if complete else 0,
                          compute_ms=round(work.compute_s * 1000, 3))
        if code:
            fields["error"] = code
        if stream_error is not None and answered:
            fields["stream_aborted"] = True
        log_request(fields)

    return finish


def init_app(app: Flask) -> None:
    app.before_request(before_request)
    app.after_request(after_request)
    app.teardown_request(teardown_request)
