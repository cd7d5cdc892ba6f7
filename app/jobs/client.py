"""This process's Dask Client, made on first use (after gunicorn's fork), and every call to
the cluster bounded in time: a job route's calls share one deadline (`cluster_deadline`),
so an unreachable or slow scheduler is 503 cluster_unavailable within 5 s, never a hung
request."""
import os
import threading
import time
from contextlib import contextmanager
from contextvars import ContextVar

from ..core.errors import cluster_unavailable

ROUTE_TIMEOUT_S = 4.5  # one route's cluster calls together, connecting included: answered within 5 s
CONNECT_TIMEOUT_S = 2.0  # at most, of what the route has left
CALL_TIMEOUT_S = 3.0  # a call outside any route's deadline
DASK_ERRORS = (OSError, TimeoutError)  # distributed's CommClosedError is an OSError
clock = time.monotonic  # the deadlines' clock

_lock = threading.Lock()
_clients: dict[tuple[int, str], object] = {}  # (pid, address): a forked copy is never reused


class CallDeadline:
    """When a route's cluster calls must all be over; grown only by the time its data needs
    to travel (a scatter, a result's transfer), known once its size is."""

    def __init__(self, seconds: float):
        self.expires = clock() + seconds

    def extend(self, seconds: float) -> None:
        self.expires += seconds

    def remaining(self) -> float:
        return self.expires - clock()


_deadline: ContextVar[CallDeadline | None] = ContextVar("blockgrad_cluster_deadline", default=None)


@contextmanager
def cluster_deadline(seconds: float = ROUTE_TIMEOUT_S):
    """Every cluster call inside shares one deadline: the outermost one's, if nested."""
    current = _deadline.get()
    if current is not None:
        yield current
        return
    deadline = CallDeadline(seconds)
    token = _deadline.set(deadline)
    try:
        yield deadline
    finally:
        _deadline.reset(token)


def current_deadline() -> CallDeadline:
    """The deadline of the route being answered: called only inside `cluster_deadline` (the
    store's @bounded operations)."""
    return _deadline.get()


def time_left(address: str, wanted: float) -> float:
    """`wanted`, or what the current deadline leaves if less: cluster_unavailable once it has passed."""
    deadline = _deadline.get()
    if deadline is None:
        return wanted
    left = min(wanted, deadline.remaining())
    if left <= 0:
        raise cluster_unavailable(address)
    return left


def cluster_client(address: str):
    """distributed is imported here, on first use: gunicorn's master, which imports the app
    before forking, never loads it."""
    from distributed import Client

    key = (os.getpid(), address)
    client = _clients.get(key)
    if client is not None and client.status not in ("closed", "closing"):
        return client
    # One thread connects; the others wait for it within their own deadlines.
    if not _lock.acquire(timeout=time_left(address, CONNECT_TIMEOUT_S)):
        raise cluster_unavailable(address)
    try:
        client = _clients.get(key)
        if client is not None and client.status not in ("closed", "closing"):
            return client
        try:
            client = Client(address, timeout=time_left(address, CONNECT_TIMEOUT_S), set_as_default=False,
                            name="blockgrad")
        except DASK_ERRORS:
            raise cluster_unavailable(address) from None
        _clients[key] = client
        return client
    finally:
        _lock.release()


def call(client, coroutine_function, *args, timeout_s: float = CALL_TIMEOUT_S, **kwargs):
    """client.<async method>(*args, **kwargs), cancelled after timeout_s or when the route's
    deadline passes, whichever is first: cluster_unavailable."""
    address = client.scheduler.address
    try:
        return client.sync(coroutine_function, *args, callback_timeout=time_left(address, timeout_s), **kwargs)
    except DASK_ERRORS:
        raise cluster_unavailable(address) from None


def cluster_report(address: str | None) -> dict:
    """What this process knows of the cluster, without asking it (for /readyz, which must not
    wait on jobs): the address, whether this process's Client is connected, and the workers
    in its last view of the scheduler (None before the first job route connected it)."""
    client = _clients.get((os.getpid(), address)) if address else None
    connected = client is not None and client.status == "running"
    workers = None
    if connected:
        identity = getattr(client, "_scheduler_identity", None) or {}  # refreshed by the Client every few s
        workers = identity.get("n_workers", len(identity.get("workers", {})) or None)
    return {"scheduler": address, "connected": connected, "workers": workers}


def close_clients(address: str | None = None) -> None:
    """This process's Clients (of `address` only, if given)."""
    with _lock:
        for key, client in list(_clients.items()):
            if address is None or key[1] == address:
                if key[0] == os.getpid():
                    client.close(timeout=CALL_TIMEOUT_S)
                del _clients[key]
