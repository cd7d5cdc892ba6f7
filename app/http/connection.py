"""The client's connection, as gunicorn hands it to the app (environ["gunicorn.socket"]).

What only the socket can tell or do, used by the request path:
- `client_gone`: a peek for end-of-file, so that a computation stops when its client leaves;
- `read_alarm`: the whole body within BLOCKGRAD_READ_TIMEOUT_S. A socket timeout bounds one
  recv, not a body a client sends a byte at a time, so one watchdog thread per process
  shuts the socket's read side at the deadline: the blocked read returns at once;
- `set_send_timeout`: a socket timeout on writes. The server writes pieces of at most
  PIECE_BYTES (sending.py), so a write that times out made no progress for about that long;
- `drop_connection`: close without writing, for a client that has gone (client_closed).
Outside gunicorn (Flask's test client) there is no socket and these do nothing.
"""
import heapq
import itertools
import math
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

SOCKET_KEY = "gunicorn.socket"
# When the request's clock started (time.monotonic(): accept, or a kept-alive connection's
# first new byte), set by the worker class (app/serving/worker.py); the read alarm counts from it.
CONN_STARTED_KEY = "blockgrad.conn_started"


def client_socket(environ: dict[str, Any]) -> socket.socket | None:
    sock = environ.get(SOCKET_KEY)
    return sock if isinstance(sock, socket.socket) else None


def client_gone(sock: socket.socket) -> bool:
    """Whether the peer has closed (EOF) or reset the connection; never blocks.

    Data waiting (a pipelined next request) means the client is still there. A client
    that half-closes after sending its request counts as gone, as for nginx.
    """
    try:
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN | select.POLLHUP | select.POLLERR)
        if not poller.poll(0):
            return False
        return sock.recv(1, socket.MSG_PEEK) == b""  # readable: recv returns at once
    except (BlockingIOError, InterruptedError):
        return False
    except (OSError, ValueError):  # reset, or already closed
        return True


def cancel_probe(environ: dict[str, Any]) -> Callable[[], bool] | None:
    sock = client_socket(environ)
    return None if sock is None else (lambda: client_gone(sock))


def set_send_timeout(environ: dict[str, Any], seconds: float) -> None:
    sock = client_socket(environ)
    if sock is not None:
        try:
            sock.settimeout(seconds)
        except OSError:
            pass


def drop_connection(environ: dict[str, Any]) -> None:
    """Shut both directions of the client's connection, so that nothing more reaches it: the
    server's next write fails (EPIPE), which servers take as the client gone, and they close."""
    sock = client_socket(environ)
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # already gone
            pass


class Alarm:
    def __init__(self, due: float, action: Callable[[], None]):
        self.due, self.action = due, action
        self.cancelled = self.fired = False


class Watchdog:
    """One daemon thread per process running each armed action at its time, unless cancelled.

    Nearly every alarm is cancelled soon after it is armed (the body has arrived): a
    cancelled alarm at the front of the heap is dropped at once, and the thread is woken
    only for an alarm due before the one it sleeps for, so that a request costs the thread
    no wake-up (each would take the GIL from the requests' threads)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Alarm]] = []
        self._order = itertools.count()
        self._pid: int | None = None
        self._wakes_at = -math.inf  # when the thread's wait ends; -inf: it is not waiting, it will look

    def arm(self, seconds: float, action: Callable[[], None]) -> Alarm:
        alarm = Alarm(time.monotonic() + seconds, action)
        with self._cond:
            if self._pid != os.getpid():  # first use in this (forked) process
                self._pid, self._heap, self._wakes_at = os.getpid(), [], -math.inf
                threading.Thread(target=self._run, name="blockgrad-watchdog", daemon=True).start()
            heapq.heappush(self._heap, (alarm.due, next(self._order), alarm))
            if alarm.due < self._wakes_at:  # due before the thread would look again: wake it
                self._cond.notify()
        return alarm

    def cancel(self, alarm: Alarm) -> None:
        with self._cond:
            alarm.cancelled = True
            self._drop_cancelled()

    def pending(self) -> int:
        """Alarms still in the heap (cancelled ones behind a live one included)."""
        with self._cond:
            return len(self._heap)

    def _drop_cancelled(self) -> None:
        while self._heap and self._heap[0][2].cancelled:
            heapq.heappop(self._heap)

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    self._drop_cancelled()
                    now = time.monotonic()
                    if self._heap and self._heap[0][0] <= now:
                        break
                    self._wakes_at = self._heap[0][0] if self._heap else math.inf
                    self._cond.wait(None if not self._heap else self._wakes_at - now)
                self._wakes_at = -math.inf
                _, _, alarm = heapq.heappop(self._heap)
                alarm.fired = True
            try:
                alarm.action()
            except Exception:  # noqa: BLE001 - a watchdog must outlive any one action
                pass


WATCHDOG = Watchdog()


def shut_reading(sock: socket.socket) -> Callable[[], None]:
    def action() -> None:
        try:
            sock.shutdown(socket.SHUT_RD)  # a blocked recv returns b"" at once; writing still works
        except OSError:
            pass
    return action


class ReadAlarm:
    """`with ReadAlarm(environ, seconds) as alarm:` read the body; `alarm.fired` if it took too long."""

    def __init__(self, environ: dict[str, Any], seconds: float):
        self.sock = client_socket(environ)
        started = environ.get(CONN_STARTED_KEY)
        self.seconds = seconds if started is None else max(0.0, started + seconds - time.monotonic())
        self.alarm: Alarm | None = None

    @property
    def fired(self) -> bool:
        return self.alarm is not None and self.alarm.fired

    def __enter__(self) -> "ReadAlarm":
        if self.sock is not None:
            self.alarm = WATCHDOG.arm(self.seconds, shut_reading(self.sock))
        return self

    def __exit__(self, *exc) -> None:
        if self.alarm is not None:
            WATCHDOG.cancel(self.alarm)
