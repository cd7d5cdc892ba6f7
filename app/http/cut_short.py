"""A streamed answer's body as the server writes it, and why it ended before its last byte.

Codes that only the log line and the errors metric carry (never an answer's body):
`client_closed` (the client went away), `send_timeout` (a write made no progress for the
send timeout), or the error that stopped the computation between two blocks.
"""
import time
from collections.abc import Callable, Iterable, Iterator

from ..core.errors import BlockgradError
from .sending import pieces
from .streaming import close_body

SEND_TIMEOUT_SHARE = 0.9  # a write that failed this late into the timeout was the timeout


class WatchedBody:
    """The answer's body in pieces of at most PIECE_BYTES; calls `finish` once, from `close`
    or after the last piece, with what cut it short: the inner body's error (e.g.
    deadline_exceeded or client_closed between two blocks), or a write that failed
    (`send_timeout` if it had waited for most of the send timeout, else `client_closed`)."""

    def __init__(self, body: Iterable[bytes], finish: Callable[[str | None], None], send_timeout_s: float):
        self.body, self.finish, self.send_timeout_s = body, finish, send_timeout_s
        self.started = self.complete = False
        self.error: str | None = None
        self.handed_at = 0.0

    def __iter__(self) -> Iterator[bytes]:
        self.started = True
        try:
            for item in self.body:
                for piece in pieces(item):
                    self.handed_at = time.monotonic()
                    yield piece
        except BlockgradError as exc:
            self.error = exc.code
            self.finish(self.error)
            raise
        except Exception:
            self.error = "internal_error"
            self.finish(self.error)
            raise
        self.complete = True
        self.finish(None)  # now, not at close: the count and log line follow the last byte

    def close(self) -> None:
        try:
            close_body(self.body)
        finally:
            error = self.error
            if error is None and self.started and not self.complete:  # the server stopped writing
                late = time.monotonic() - self.handed_at >= SEND_TIMEOUT_SHARE * self.send_timeout_s
                error = "send_timeout" if late else "client_closed"
            self.finish(error)
