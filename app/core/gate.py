"""The compute gate: one computation at a time per worker, a bounded FIFO queue in front.

A worker's torch threads are sized to the cores it owns, so two computations at once
would only share those cores and both finish later. Threads beyond the slot serve
connections, probes and slow clients; those that want to compute wait here, at most
`queue_depth` of them, first come first served. One more is refused at once
(`overloaded`, 503 with Retry-After) instead of waiting unseen in a socket backlog.
The wait counts against the request's deadline (`deadline_exceeded`, details.queued)
and stops when the client goes away (`client_closed`).

`acquire` takes the request's `Cost`: today every request costs the one slot; a
memory budget (bytes reserved while computing) can be checked and reserved in
`_fits`/`_take`/`_give_back` without changing the callers.
Standard library only (threading): no HTTP and no metrics here; `GateListener`
reports depth, waits and refusals to whoever counts them.
"""
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import client_closed, deadline_exceeded, overloaded
from .settings import COMPUTE_SLOTS

if TYPE_CHECKING:  # a type only: importing run would load torch
    from .run import Deadline

WAIT_POLL_S = 0.1  # how often a waiting request looks at its deadline and its client


@dataclass(frozen=True)
class Cost:
    """What a request holds while it computes. Sizes now; a memory reservation later."""
    n: int
    dim: int
    factor: int


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

    def __init__(self, gate: "Gate", cost: Cost):
        self.gate, self.cost = gate, cost
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

    def acquire(self, cost: Cost, deadline: "Deadline") -> Ticket:
        """The slot for `cost`, waiting in line up to the deadline; overloaded if the line is full."""
        start = time.monotonic()
        with self._lock:
            if not self._queue and self._fits(cost):
                self._take(cost)
                self.listener.waited(0.0)
                return Ticket(self, cost)
            if len(self._queue) >= self.queue_depth:
                self.listener.shed()
                raise overloaded(self.queue_depth)
            token = object()
            self._queue.append(token)
            self.listener.waiting(len(self._queue))
            try:
                while not (self._queue[0] is token and self._fits(cost)):
                    remaining = deadline.remaining()
                    if remaining <= 0:
                        raise deadline_exceeded(deadline.timeout_s, queued=True)
                    self._lock.wait(min(remaining, WAIT_POLL_S))
                    if deadline.cancelled is not None and deadline.cancelled():
                        raise client_closed()
                self._take(cost)
            finally:
                self._queue.remove(token)
                self.listener.waiting(len(self._queue))
                self._lock.notify_all()  # the next in line may now be first
        self.listener.waited(time.monotonic() - start)
        return Ticket(self, cost)

    def _release(self, ticket: Ticket) -> None:
        with self._lock:
            if ticket.released:
                return
            ticket.released = True
            self._give_back(ticket.cost)
            self._lock.notify_all()

    # The resource accounting; a memory reservation extends these three.
    def _fits(self, cost: Cost) -> bool:
        return self._busy < self.slots

    def _take(self, cost: Cost) -> None:
        self._busy += 1

    def _give_back(self, cost: Cost) -> None:
        self._busy -= 1
