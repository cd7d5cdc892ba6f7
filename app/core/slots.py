"""Compute slots: the right to keep one core busy, the bounded queue in front of them,
and a request's deadline, which bounds its wait there and its computation.

`SlotSource` is what the gate and the executor (app/core/run.py) need: a slot now if one
is free and nobody waits for one (`try_acquire`), or a bounded wait for one (`acquire`).
`ThreadSlots` are the slots of one process (tests, a development server); gunicorn's
workers share the pod's (app/serving/slots.py, flock'd files), which satisfy the same
protocol, so a request takes a free core wherever it is.

The gate: threads beyond the slots serve connections, probes and slow clients; those that
want to compute wait in the gate, at most `queue_depth` of them per worker, first come
first served: the first in line waits on the source (which wakes it when a slot anywhere
is released), the others behind it. One more is refused at once (`overloaded`, 503 with
Retry-After) instead of waiting unseen in a socket backlog. The wait counts against the
request's deadline (`deadline_exceeded`, details.queued) and stops when the client goes
away (`client_closed`).

Memory is not the gate's: the worker's ledger (app/core/admission.py) admits it before a
request queues. Standard library only (threading): no HTTP and no metrics here;
`GateListener` reports depth, waits and refusals to whoever counts them.
"""
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

from .errors import client_closed, deadline_exceeded, overloaded
from .settings import COMPUTE_SLOTS

WAIT_POLL_S = 0.1  # how often a waiting request looks at its deadline and its client


class Slot(Protocol):
    def release(self) -> None:
        """Give the slot back; idempotent."""


class SlotSource(Protocol):
    """Compute slots, one per core: local to a process or shared by a pod."""
    count: int  # slots in all

    @property
    def busy(self) -> int:
        """Slots held now, by anyone (in the pod, for the pod's)."""

    def try_acquire(self) -> Slot | None:
        """A slot free right now, unless someone is waiting for one (they go first)."""

    def acquire(self, timeout: float | None = None) -> Slot | None:
        """A slot, waiting at most `timeout` seconds (None: no limit); None on timeout."""


class LocalSlot:
    """One held slot of a ThreadSlots."""

    def __init__(self, source: "ThreadSlots"):
        self._source, self._released = source, False

    def release(self) -> None:
        with self._source._cond:
            if self._released:
                return
            self._released = True
            self._source._free += 1
            self._source._cond.notify()


class ThreadSlots:
    """Slots of one process (a development server, tests); a pod shares app/serving/slots.py's."""

    def __init__(self, count: int):
        self.count = count
        self._free = count
        self._waiting = 0
        self._cond = threading.Condition()

    @property
    def busy(self) -> int:
        with self._cond:
            return self.count - self._free

    def try_acquire(self) -> LocalSlot | None:
        with self._cond:
            if self._free == 0 or self._waiting:
                return None
            self._free -= 1
            return LocalSlot(self)

    def acquire(self, timeout: float | None = None) -> LocalSlot | None:
        with self._cond:
            self._waiting += 1
            try:
                if not self._cond.wait_for(lambda: self._free > 0, timeout):
                    return None
                self._free -= 1
                return LocalSlot(self)
            finally:
                self._waiting -= 1


class Deadline:
    """Past it, or once the client has gone, the request stops and frees its tensors.

    `started`: time.monotonic() at the request's arrival (default now), so that time spent
    reading the body and waiting for the compute slot counts. `cancelled`: asks whether the
    client has gone (the HTTP layer peeks at the connection); polled at most every
    CANCEL_POLL_S, so that tiny blocks do not each cost a system call.
    """
    CANCEL_POLL_S = 0.02

    def __init__(self, timeout_s: float, started: float | None = None,
                 cancelled: Callable[[], bool] | None = None):
        self.timeout_s = timeout_s
        self.expires = (time.monotonic() if started is None else started) + timeout_s
        self.cancelled = cancelled
        self.next_poll = 0.0

    def remaining(self) -> float:
        return self.expires - time.monotonic()

    def check(self) -> None:
        now = time.monotonic()
        if now > self.expires:
            raise deadline_exceeded(self.timeout_s)
        if self.cancelled is not None and now >= self.next_poll:
            self.next_poll = now + self.CANCEL_POLL_S
            if self.cancelled():
                raise client_closed()


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

    def __init__(self, gate: "Gate", slot: Slot):
        self.gate, self.slot = gate, slot
        self.released = False

    def release(self) -> None:
        self.gate._release(self)


class Gate:
    def __init__(self, queue_depth: int, slots: int | SlotSource = COMPUTE_SLOTS,
                 listener: GateListener | None = None):
        self.queue_depth = queue_depth
        self.source = ThreadSlots(slots) if isinstance(slots, int) else slots
        self.listener = listener or GateListener()
        self._lock = threading.Condition()
        self.busy = 0  # first slots this worker's requests hold (a request's extra chunks' slots not counted)
        self._queue: deque[object] = deque()  # one token per waiting request, in arrival order

    @property
    def depth(self) -> int:
        return len(self._queue)

    def acquire(self, deadline: Deadline) -> Ticket:
        """A slot, waiting in line up to the deadline; overloaded if the line is full."""
        start = time.monotonic()
        ticket, queued = self._take(deadline, resuming=False)
        self.listener.waited(time.monotonic() - start if queued else 0.0)
        return ticket

    def resume(self, deadline: Deadline) -> Ticket:
        """A slot again for a request that is already answering (a stream between the bands
        it recomputes): never refused for a full line, and next in it, behind only the first
        (already waiting on the slots). Not a request's wait: the listener hears nothing of it."""
        return self._take(deadline, resuming=True)[0]

    def _take(self, deadline: Deadline, resuming: bool) -> tuple[Ticket, bool]:
        """The ticket, and whether it waited in line: a free slot at once unless others are in
        line (a resuming request is not held back by them), else a place in line."""
        with self._lock:
            slot = self.source.try_acquire() if resuming or not self._queue else None
            if slot is not None:
                self.busy += 1
                return Ticket(self, slot), False
            if not resuming and len(self._queue) >= self.queue_depth:
                self.listener.shed()
                raise overloaded(self.queue_depth)
            token = object()
            self._queue.insert(min(1, len(self._queue)) if resuming else len(self._queue), token)
            self.listener.waiting(len(self._queue))
        try:
            slot = self._wait_in_line(token, deadline)
        finally:  # out of the line, waited for or not
            with self._lock:
                self._queue.remove(token)
                self.listener.waiting(len(self._queue))
                self._lock.notify_all()  # the next in line may now be first
        return Ticket(self, slot), True

    def _wait_in_line(self, token: object, deadline: Deadline) -> Slot:
        """First in line: wait on the source for a slot; behind it: for the first to leave."""
        while True:
            remaining = deadline.remaining()
            if remaining <= 0:
                raise deadline_exceeded(deadline.timeout_s, queued=True)
            with self._lock:
                first = self._queue[0] is token
                if not first:
                    self._lock.wait(min(remaining, WAIT_POLL_S))
            if first:
                slot = self.source.acquire(timeout=min(remaining, WAIT_POLL_S))
                if slot is not None:
                    with self._lock:
                        self.busy += 1
                    return slot
            if deadline.cancelled is not None and deadline.cancelled():
                raise client_closed()

    def _release(self, ticket: Ticket) -> None:
        with self._lock:
            if ticket.released:
                return
            ticket.released = True
            ticket.slot.release()
            self.busy -= 1
            self._lock.notify_all()
