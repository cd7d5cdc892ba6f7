"""The compute gate: one computation at a time per worker, a bounded FIFO queue in front.

A worker's torch threads are sized to the cores it owns, so two computations at once
would only share those cores and both finish later. Threads beyond the slot serve
connections, probes and slow clients; those that want to compute wait here, at most
`queue_depth` of them, first come first served. One more is refused at once
(`overloaded`, 503 with Retry-After) instead of waiting unseen in a socket backlog.
The wait counts against the request's deadline (`deadline_exceeded`, details.queued)
and stops when the client goes away (`client_closed`).

Memory is not the gate's: the worker's ledger (app/core/memory.py) admits it before a
request queues. Standard library only (threading): no HTTP and no metrics here; `GateListener`
reports depth, waits and refusals to whoever counts them.
"""
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

from .errors import client_closed, deadline_exceeded, overloaded
from .settings import COMPUTE_SLOTS

if TYPE_CHECKING:  # a type only: importing run would load torch
    from .deadline import Deadline

WAIT_POLL_S = 0.1  # how often a waiting request looks at its deadline and its client


class GateListener:
    """Hooks for metrics; the defaults do nothing."""

    def waiting(self, depth: int) -> None:
        """The number of requests waiting changed to `depth`."""

    def waited(self, seconds: float) -> None:
        """A request got the slot after waiting `seconds` (0 when it was free)."""

    def shed(self) -> None:
        """A request was refused: the queue was full."""


class Ticket:
    """The slot, held until `release` (idempotent: a stream's end and its close both call it)."""

    def __init__(self, gate: "Gate"):
        self.gate = gate
        self.released = False

    def release(self) -> None:
        self.gate._release(self)

    def __enter__(self) -> "Ticket":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class Gate:
    def __init__(self, queue_depth: int, slots: int = COMPUTE_SLOTS, listener: GateListener | None = None):
        self.queue_depth = queue_depth
        self.slots = slots
        self.listener = listener or GateListener()
        self._lock = threading.Condition()
        self._busy = 0
        self._queue: deque[object] = deque()  # one token per waiting request, in arrival order

    @property
    def depth(self) -> int:
        return len(self._queue)

    @property
    def busy(self) -> int:
        return self._busy

    def acquire(self, deadline: "Deadline") -> Ticket:
        """The slot, waiting in line up to the deadline; overloaded if the line is full."""
        start = time.monotonic()
        with self._lock:
            if not self._queue and self._busy < self.slots:
                self._busy += 1
                self.listener.waited(0.0)
                return Ticket(self)
            if len(self._queue) >= self.queue_depth:
                self.listener.shed()
                raise overloaded(self.queue_depth)
            token = object()
            self._queue.append(token)
            self.listener.waiting(len(self._queue))
            try:
                while not (self._queue[0] is token and self._busy < self.slots):
                    remaining = deadline.remaining()
                    if remaining <= 0:
                        raise deadline_exceeded(deadline.timeout_s, queued=True)
                    self._lock.wait(min(remaining, WAIT_POLL_S))
                    if deadline.cancelled is not None and deadline.cancelled():
                        raise client_closed()
                self._busy += 1
            finally:
                self._queue.remove(token)
                self.listener.waiting(len(self._queue))
                self._lock.notify_all()  # the next in line may now be first
        self.listener.waited(time.monotonic() - start)
        return Ticket(self)

    def _release(self, ticket: Ticket) -> None:
        with self._lock:
            if ticket.released:
                return
            ticket.released = True
            self._busy -= 1
            self._lock.notify_all()
