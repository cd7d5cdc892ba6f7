"""Which complete request of one worker runs next: one at a time, unless the next has waited.

Two requests' threads in one process take turns on the GIL at every torch call and system call
of either; for small requests those hand-offs cost more CPU than running side by side gains
(docs/small-requests.md). So a complete request waits for the one running to end, at most
`hold_s`, then runs beside it: a long request delays the next by that much only.

A waiting request is either the main loop's (a head read by the poller: `add`; the thread
that ends a request takes it, `take_next`, or the main loop's `due` starts it on a pool
thread) or a pool thread's own (a lingering connection's head, app/serving/lingering.py:
`wait_for_turn` waits on the thread's inbox until it is woken or `hold_s` has passed). The queue is in arrival order. Standard library only: the
master loads this module.
"""
from queue import Empty, SimpleQueue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any


class Turns:
    def __init__(self, hold_s: float, new_inbox: Callable[[], SimpleQueue] = SimpleQueue):
        self.hold_s = hold_s
        self._lock = threading.Lock()
        self._inboxes = threading.local()  # each pool thread's inbox, where it waits for its turn
        self._new_inbox = new_inbox
        self._queue: deque[tuple[Any, float, SimpleQueue | None]] = deque()  # (item, since, inbox)
        self.running = 0  # requests being served

    # -- the main loop ---------------------------------------------------------------------

    def add(self, item: Any, now: float) -> None:
        """A complete head read by the main loop waits for its turn."""
        with self._lock:
            self._queue.append((item, now, None))

    def due(self, now: float) -> list:
        """The main loop's items whose turn it is (nothing runs, or they have waited hold_s),
        in arrival order, counted as running; a pool thread's waiting item is woken instead."""
        started = []
        with self._lock:
            while self._queue:
                item, since, inbox = self._queue[0]
                if self.running and now - since < self.hold_s:
                    break
                self._queue.popleft()
                self.running += 1
                if inbox is None:
                    started.append(item)
                else:
                    inbox.put(item)
        return started

    def oldest(self) -> float | None:
        """When the longest-waiting item arrived (the main loop wakes hold_s after it)."""
        with self._lock:
            return self._queue[0][1] if self._queue else None

    # -- pool threads ----------------------------------------------------------------------

    def finish(self) -> None:
        """The calling thread's request has ended. If the next item is a pool thread's, its turn
        has come and it is woken; the main loop's is left for `take_next`."""
        with self._lock:
            self.running -= 1
            if self.running or not self._queue:
                return
            item, _, inbox = self._queue[0]
            if inbox is None:
                return
            self._queue.popleft()
            self.running += 1
            inbox.put(item)

    def take_next(self) -> Any:
        """On a thread that is free: the main loop's next item, if its turn has come (a pool
        thread's is woken instead)."""
        with self._lock:
            if self.running or not self._queue:
                return None
            item, _, inbox = self._queue.popleft()
            self.running += 1
            if inbox is not None:
                inbox.put(item)
                return None
        return item

    def wait_for_turn(self, item: Any) -> None:
        """A pool thread has a complete head for `item`: return when it may run, at once when
        nothing runs, else when the running request ends or after hold_s at the latest."""
        inbox = self._inbox()
        with self._lock:
            if not self.running:
                self.running = 1
                return
            entry = (item, time.monotonic(), inbox)
            self._queue.append(entry)
        try:
            inbox.get(timeout=self.hold_s)
            return
        except Empty:
            pass
        with self._lock:
            try:
                self._queue.remove(entry)
            except ValueError:  # its turn came as the hold ended: the waker, counting it, put it there
                inbox.get_nowait()
                return
            self.running += 1

    def _inbox(self) -> SimpleQueue:
        inbox = getattr(self._inboxes, "inbox", None)
        if inbox is None:
            inbox = self._inboxes.inbox = self._new_inbox()
        return inbox
