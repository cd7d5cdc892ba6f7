"""Per-request bookkeeping: request id, timing, and when the answer is complete,
one metrics update (metrics.py) and one JSON log line (request_log.py).

"Complete" means after the last body byte for a streamed answer (the
/v1/gradients blocks), so its latency, outputs and compute time include the
stream; for any other answer it is right after the view. Views describe their
work by setting `g.work` (a `Work`) and `g.device`; the error handler sets
`g.error_code` (errors.py).
"""
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from flask import Flask, Response, g, request

from ..core.errors import BlockgradError
from ..core.limits import output_elements
from . import metrics
from .request_log import REQUEST_ID_HEADER, log_request, request_id_from


@dataclass
class Work:
    """What one computing request did; the view fills it, the log line and metrics read it."""
    n: int
    dim: int
    factor: int
    outputs: tuple[str, ...]
    output_numbers: int  # numbers in the full answer (see limits.output_elements)
    compute_s: float = 0.0

    @classmethod
    def of(cls, n: int, dim: int, factor: int, outputs: tuple[str, ...],
           computed: tuple[str, ...] | None = None) -> "Work":
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


def before_request() -> None:
    g.started = time.perf_counter()
    g.request_id = request_id_from(request.headers.get(REQUEST_ID_HEADER))
    metrics.IN_FLIGHT.inc()
    g.in_flight = True


def after_request(response: Response) -> Response:
    if "request_id" not in g:  # an earlier before_request hook refused the request
        g.request_id = request_id_from(request.headers.get(REQUEST_ID_HEADER))
    response.headers[REQUEST_ID_HEADER] = g.request_id
    finish = finisher(response.status_code)
    if response.is_streamed:
        response.response = finish_after(response.response, finish)
    else:
        finish(None)
    return response


def finisher(status: int) -> Callable[[str | None], None]:
    """Capture what the request knows now; the stream may end after its context is gone."""
    started = g.get("started", time.perf_counter())
    in_flight = g.pop("in_flight", False)
    route = request.url_rule.rule if request.url_rule else "unmatched"
    method, request_id = request.method, g.request_id
    work: Work | None = g.get("work")
    device: str | None = g.get("device")
    error_code: str | None = g.get("error_code")

    def finish(stream_error: str | None) -> None:
        """`stream_error`: the code of what cut a streamed body short, if anything did."""
        duration_s = time.perf_counter() - started
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
        if work is not None:
            complete = status == 200 and stream_error is None
            metrics.observe_work(work.output_numbers if complete else 0, work.compute_s)
            fields.update(n=work.n, dim=work.dim, factor=work.factor, outputs=list(work.outputs),
                          output_numbers=work.output_numbers if complete else 0,
                          compute_ms=round(work.compute_s * 1000, 3))
        if code:
            fields["error"] = code
        if stream_error is not None:
            fields["stream_aborted"] = True
        log_request(fields)

    return finish


def finish_after(body: Iterable[bytes], finish: Callable[[str | None], None]) -> Iterator[bytes]:
    """Pass the body through; call `finish` once, when it ends, fails or is closed early."""
    error: str | None = None
    try:
        yield from body
    except GeneratorExit:  # the server closed it early: the client went away
        error = "client_closed"
        raise
    except BlockgradError as exc:  # e.g. deadline_exceeded between two blocks
        error = exc.code
        raise
    except Exception:
        error = "internal_error"
        raise
    finally:
        close = getattr(body, "close", None)
        if close is not None:
            close()
        finish(error)


def init_app(app: Flask) -> None:
    app.before_request(before_request)
    app.after_request(after_request)
