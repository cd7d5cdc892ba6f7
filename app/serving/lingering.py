"""A worker's kept-alive connections waiting for their next head, with no thread of their own.

Having answered a kept-alive connection, a pool thread puts it here for up to linger_s, then
takes the next complete head itself, whichever connection sends it: the main loop's (Turns),
or one of these, polling them all (one thread at a time). A busy worker's kept-alive clients
are so served one after another by one thread, as a sync worker serves its queue: no thread
wakes for a head that arrives while a request runs, nor takes the GIL from it
(docs/small-requests.md). One that sends nothing within linger_s goes back to the poller.

While the thread that polled them serves a request, no thread polls: a head arriving then
waits for that request to end. So that a long request delays it by little, the main loop looks
at them every look_s while any linger (`look`; it takes nothing while a thread polls them) and
takes back a head it has seen waiting at two looks in a row. Standard library only: the master
loads this module.
"""
import contextlib
import os
import select
import threading
from typing import Any


class Lingering:
    def __init__(self, linger_s: float, look_s: float, limit: int):
        self.linger_s, self.look_s, self.limit = linger_s, look_s, max(1, limit)
        self._lock = threading.Lock()
        self._due: dict[Any, float] = {}  # conn -> when it goes back to the poller, in the order answered
        self._seen: dict[Any, float] = {}  # the main loop's: when it first found a conn readable, no thread polling
        self.watched = False  # a pool thread polls them
        self.looking = False  # the main loop looks again within look_s (set by `look`)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    def __len__(self) -> int:
        return len(self._due)

    # -- pool threads ----------------------------------------------------------------------

    def add(self, conn: Any, now: float) -> bool:
        """`conn` has been answered and is kept alive: it waits here (False: full, it goes to the poller)."""
        with self._lock:
            if len(self._due) >= self.limit:
                return False
            self._due[conn] = now + self.linger_s
            watched = self.watched
        if watched:  # the watching thread's poll does not include it yet
            self.wake()
        return True

    def watch(self) -> list[tuple[Any, float]] | None:
        """The calling thread polls them (`wait`) until `unwatch`: their (conn, due), or None
        when there are none or another thread polls them."""
        with self._lock:
            if self.watched or not self._due:
                return None
            self.watched = True
            self._seen.clear()
            return list(self._due.items())

    def wait(self, watched: list[tuple[Any, float]], now: float) -> list:
        """Block until one of `watched` is readable (a head, or a close), the earliest is due,
        or `wake`; the readable ones, in the order they were answered."""
        poller, by_fd = polling([conn for conn, _ in watched])
        poller.register(self._wake_r, select.POLLIN)
        timeout_ms = max(0.0, min(due for _, due in watched) - now) * 1000
        ready = set()
        for fd, _ in poller.poll(timeout_ms):
            if fd == self._wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)
            elif fd in by_fd:
                ready.add(by_fd[fd])
        return [conn for conn, _ in watched if conn in ready]

    def claim(self, conn: Any) -> bool:
        """Take `conn` out to serve it (False: the main loop took it back first)."""
        with self._lock:
            self._seen.pop(conn, None)
            return self._due.pop(conn, None) is not None

    def expired(self, now: float) -> list:
        """Those due back to the poller, taken out."""
        with self._lock:
            return self._take_due(now)

    def _take_due(self, now: float) -> list:
        gone = [conn for conn, due in self._due.items() if due <= now]
        for conn in gone:
            del self._due[conn]
            self._seen.pop(conn, None)
        return gone

    def unwatch(self) -> None:
        """The watching thread stops polling."""
        with self._lock:
            self.watched = False

    def left_alone(self) -> bool:
        """Whether some wait with no thread polling and the main loop not looking: a pool
        thread that leaves them so wakes the main loop."""
        with self._lock:
            return bool(self._due) and not self.watched and not self.looking

    def wake(self) -> None:
        """Interrupt the watching thread's poll (a connection added, the pool's backlog, stop).
        The pipe is never closed: it lives as long as the worker process."""
        with contextlib.suppress(BlockingIOError):  # full: a wake is pending already
            os.write(self._wake_w, b"\0")

    # -- the main loop ---------------------------------------------------------------------

    def look(self, now: float, everything: bool = False) -> tuple[list, list[tuple[Any, float]]]:
        """The main loop's look, every look_s while any wait (`looking`): (those due back to
        the poller, or all with `everything`; those whose next head has waited since the
        previous look with no thread polling, each with when it was first seen)."""
        with self._lock:
            if everything:
                back, self._due = list(self._due), {}
                self._seen.clear()
                self.looking = False
                return back, []
            back, taken = [], []
            if self.watched or not self._due:  # the polling thread sends back those due itself
                self._seen.clear()
            else:
                back = self._take_due(now)
                poller, by_fd = polling(list(self._due))
                readable = {by_fd[fd] for fd, _ in poller.poll(0)}
                self._seen = {conn: since for conn, since in self._seen.items() if conn in readable}
                for conn in readable:
                    since = self._seen.setdefault(conn, now)
                    if now - since >= self.look_s:
                        del self._due[conn], self._seen[conn]
                        taken.append((conn, since))
            self.looking = bool(self._due)
            return back, taken


def polling(conns: list) -> tuple[select.poll, dict[int, Any]]:
    """A poll object over the connections' sockets, and the connection of each descriptor."""
    poller, by_fd = select.poll(), {}
    for conn in conns:
        fd = conn.sock.fileno()
        if fd >= 0:  # -1: closed since (taken back and closed by the main loop)
            by_fd[fd] = conn
            poller.register(fd, select.POLLIN)
    return poller, by_fd
