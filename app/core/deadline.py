"""A request's deadline, checked between blocks and while it waits for the compute slot."""
import time
from collections.abc import Callable

from .errors import client_closed, deadline_exceeded


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
