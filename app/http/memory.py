"""The worker's memory ledger as the front ends use it: one reservation per request, grown
with its body as it arrives (within the uploads' share while it is still arriving), resized to
the request's predicted peak once its sizes are known, and released when its answer has been
written (request_record.py's finish).

Under gthread the ledger is what lets a worker hold several requests (computing, queued,
bodies being parsed) without their sum passing BLOCKGRAD_WORKER_MEMORY_BYTES.
"""
from flask import g

from ..extensions import services


def reserve_for_request(nbytes: int) -> None:
    """Hold `nbytes` for this request (replacing what it held): limit_exceeded (413) over the
    budget alone, overloaded (503, Retry-After) when only the other requests are in the way."""
    hold(nbytes, services().ledger.reserve)


def hold_for_upload(nbytes: int) -> None:
    """Hold `nbytes` for this request's body while more of it is to come: within the budget and
    the uploads' share (overloaded when other bodies still arriving fill it)."""
    hold(nbytes, services().ledger.reserve_upload)


def hold(nbytes: int, reserve) -> None:
    """Resize this request's reservation to `nbytes`, or take one with `reserve`."""
    held = g.get("memory_reservation")
    if held is None:
        g.memory_reservation = reserve(nbytes)
    else:
        held.resize(nbytes)


def reserve_for_body(nbytes: int) -> None:
    """The body has arrived: hold `nbytes` (what parsing it may take) against the budget only."""
    held = g.get("memory_reservation")
    if held is not None:
        held.settle()
    reserve_for_request(nbytes)


def release_held(state) -> None:
    """Give back what the request whose `g` is `state` reserved, if anything (idempotent);
    `state` may outlive the request context (a stream's end)."""
    held = getattr(state, "memory_reservation", None)
    if held is not None:
        held.release()
