"""The worker's memory ledger as the front ends use it: one reservation per request, taken
for its body before it is read, resized to the request's predicted peak once its sizes are
known, and released when its answer has been written (request_record.py's finish).

Under gthread the ledger is what lets a worker hold several requests (computing, queued,
bodies being parsed) without their sum passing BLOCKGRAD_WORKER_MEMORY_BYTES.
"""
from flask import g

from ..extensions import services


def reserve_for_request(nbytes: int) -> None:
    """Hold `nbytes` for this request (replacing what it held): limit_exceeded (413) over the
    budget alone, overloaded (503, Retry-After) when only the other requests are in the way."""
    held = g.get("memory_reservation")
    if held is None:
        g.memory_reservation = services().ledger.reserve(nbytes)
    else:
        held.resize(nbytes)


def release_held(state) -> None:
    """Give back what the request whose `g` is `state` reserved, if anything (idempotent);
    `state` may outlive the request context (a stream's end)."""
    held = getattr(state, "memory_reservation", None)
    if held is not None:
        held.release()
