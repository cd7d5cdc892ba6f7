"""The worker's compute slot as the pipeline uses it: its metrics, and a body that keeps the
slot until the server has written (or dropped) the last computed block.

Probes, /metrics and the docs never come here: only computing requests wait.
"""
from collections.abc import Iterable, Iterator

from ..core.gate import GateListener, Ticket
from . import metrics
from .streaming import close_body


class MetricsListener(GateListener):
    def waiting(self, depth: int) -> None:
        metrics.QUEUE_DEPTH.set(depth)

    def waited(self, seconds: float) -> None:
        metrics.QUEUE_WAIT.observe(seconds)

    def shed(self) -> None:
        metrics.SHED.inc()


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


def held_until_written(body: Iterable[bytes], ticket: Ticket, computes: bool) -> Iterable[bytes]:
    """`body` with the slot held while it is written; `computes`: whether producing it still
    runs the engine (blocks recomputed as they are streamed). When all is computed the slot
    goes to the next request now: a client that reads slowly then holds its thread (up to
    BLOCKGRAD_SEND_TIMEOUT_S without progress), never the worker's compute slot."""
    if not computes:
        ticket.release()
        return body
    return HeldBody(body, ticket)
