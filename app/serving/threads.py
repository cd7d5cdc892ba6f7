"""The worker's pool threads, each woken alone for the connection it is given.

gthread hands connections to a ThreadPoolExecutor, whose idle threads all wait on one shared
queue: every hand-over wakes a second idle thread too (the queue's lock passes on to the next
waiter), which takes the GIL, finds nothing and sleeps again, and each request pays for a
Future and its callbacks. Here an idle thread waits on a queue of its own; a connection goes
to the most recently idle one, or to a new thread up to `size`, or waits in a backlog that the
next thread to finish takes from. A thread that has finished also asks `take_next` for work
its owner holds back (the worker's complete heads waiting for the running request to end),
so that it goes from one request to the next without sleeping; `on_backlog` is told when a
connection waits for a thread (the worker's thread polling its lingering connections then
stops to take it). Standard library only: the master loads this module.
"""
import queue
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

STOP = object()


class ServingThreads:
    """`submit(conn)` runs `handle(conn)` on a pool thread, which answers for `conn` from then
    on; `done(conn, None)` when the pool is stopping, and as a backstop should handle raise
    (the owner closes it; the worker's handle never raises). submit raises RuntimeError when no thread can start. Daemon threads: a stopping worker
    waits for its connections itself (gthread's graceful timeout), never for idle threads."""

    def __init__(self, size: int, handle: Callable[[Any], Any], done: Callable[[Any, Any], None],
                 take_next: Callable[[], Any] = lambda: None, on_backlog: Callable[[], None] = lambda: None):
        self.size, self.handle, self.done, self.take_next = max(1, size), handle, done, take_next
        self.on_backlog = on_backlog
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue] = []  # LIFO: the most recently idle thread's cache is warm
        self._backlog: deque = deque()
        self._threads = 0
        self._stopping = False

    def submit(self, conn) -> None:
        with self._lock:
            stopping = self._stopping
            if not stopping and self._idle:
                self._idle.pop().put(conn)
                return
            backlog = not stopping and self._threads >= self.size
            if backlog:
                self._backlog.append(conn)
            elif not stopping:
                self._threads += 1
        if backlog:
            self.on_backlog()
            return
        if stopping:  # too late to serve it: the main loop closes it
            self.done(conn, None)
            return
        try:
            threading.Thread(target=self._run, args=(conn,), name="serving", daemon=True).start()
        except BaseException:
            with self._lock:
                self._threads -= 1
            raise

    def backlogged(self) -> bool:
        """Whether connections wait for a free thread (read without the lock: a hint)."""
        return bool(self._backlog)

    def shutdown(self, wait: bool = False) -> None:
        """No new work; idle threads end. `wait` is not supported (gthread never waits)."""
        with self._lock:
            self._stopping = True
            idle, self._idle = self._idle, []
        for inbox in idle:
            inbox.put(STOP)

    def _run(self, conn) -> None:
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        while conn is not STOP:
            try:
                self.handle(conn)
            except BaseException:  # noqa: BLE001 - the owner closes the connection
                self.done(conn, None)
            following = self.take_next()
            if following is not None:
                conn = following
                continue
            with self._lock:
                if self._backlog:
                    conn = self._backlog.popleft()
                    continue
                if self._stopping:
                    break
                self._idle.append(inbox)
            conn = inbox.get()
        with self._lock:
            self._threads -= 1
