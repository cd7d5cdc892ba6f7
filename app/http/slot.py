"""The worker's compute gate as the front ends use it: a request's deadline (from its
arrival, with a cancel check on its connection), the slot around `run`, and a body
that keeps the slot until the server has written (or dropped) the last block.

Probes, /metrics and the docs never come here: only computing requests wait.
"""
import time
from collections.abc import Iterable, Iterator

from flask import Flask, current_app, g, request

from ..core.gate import Cost, Gate, GateListener, Ticket
from ..core.request import GradientRequest
from ..core import run as core_run  # core_run.Deadline looked up per request (tests replace it)
from ..core.settings import COMPUTE_SLOTS, Settings
from . import metrics
from .connection import cancel_probe
from .settings import current_settings
from .streaming import close_body

EXTENSION = "blockgrad_gate"


class MetricsListener(GateListener):
    def waiting(self, depth: int) -> None:
        metrics.QUEUE_DEPTH.set(depth)

    def waited(self, seconds: float) -> None:
        metrics.QUEUE_WAIT.observe(seconds)

    def shed(self) -> None:
        metrics.SHED.inc()


def install_gate(app: Flask, settings: Settings) -> None:
    app.extensions[EXTENSION] = Gate(settings.queue_depth, slots=COMPUTE_SLOTS, listener=MetricsListener())


def current_gate() -> Gate:
    return current_app.extensions[EXTENSION]


def request_deadline() -> core_run.Deadline:
    """This request's deadline, counted from its arrival; stops when its client goes away."""
    if "deadline" not in g:
        g.deadline = core_run.Deadline(current_settings().request_timeout_s, started=g.get("arrived", time.monotonic()),
                              cancelled=cancel_probe(request.environ))
    return g.deadline


def compute_slot(req: GradientRequest, deadline: core_run.Deadline) -> Ticket:
    """Wait for this worker's compute slot (overloaded / deadline_exceeded / client_closed)."""
    return current_gate().acquire(Cost(req.n, req.dim, req.factor), deadline)


class HeldBody:
    """A streamed body that holds the slot while its blocks are computed and written; the
    slot is released when it ends or when the server closes it (client gone, write failed)."""

    def __init__(self, body: Iterable[bytes], ticket: Ticket):
        self.body, self.ticket = body, ticket

    def __iter__(self) -> Iterator[bytes]:
        try:
            yield from self.body
        finally:
            self.ticket.release()

    def close(self) -> None:
        try:
            close_body(self.body)
        finally:
            self.ticket.release()


def held_until_written(body: bytes | Iterable[bytes], ticket: Ticket,
                       computes: bool = True) -> bytes | Iterable[bytes]:
    """`body` with the slot held while it is written; `computes`: whether producing it still
    runs the engine (blocks recomputed as they are streamed). When all is computed the slot
    goes to the next request now: a client that reads slowly then holds its thread (up to
    BLOCKGRAD_SEND_TIMEOUT_S without progress), never the worker's compute slot."""
    if isinstance(body, (bytes, bytearray)) or not computes:
        ticket.release()
        return body
    return HeldBody(body, ticket)
