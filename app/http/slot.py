"""The compute slot as the pipeline uses it: its metrics, and the slots of a stream that
recomputes its blocks as it writes them.

Probes, /metrics and the docs never come here: only computing requests wait.
"""
from collections.abc import Iterator
from contextlib import contextmanager

from ..core.slots import Deadline, Gate, GateListener
from . import metrics


class MetricsListener(GateListener):
    def waiting(self, depth: int) -> None:
        metrics.QUEUE_DEPTH.set(depth)

    def waited(self, seconds: float) -> None:
        metrics.QUEUE_WAIT.observe(seconds)

    def shed(self) -> None:
        metrics.SHED.inc()


class BandSlots:
    """`Result.band_slot` of a request: a compute slot while each band of blocks is
    recomputed, none while the band is written. The request's own slot was given back once
    its answer was rendered; each band takes one again (`Gate.resume`: ahead of the line,
    never refused, against the request's deadline). So a client that reads slowly holds
    its thread, never a compute slot: another request computes meanwhile."""

    def __init__(self, gate: Gate, deadline: Deadline):
        self.gate, self.deadline = gate, deadline

    @contextmanager
    def __call__(self) -> Iterator[None]:
        ticket = self.gate.resume(self.deadline)
        try:
            yield
        finally:
            ticket.release()  # before the band's blocks go to the socket
