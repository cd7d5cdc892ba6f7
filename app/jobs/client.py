"""This process's Dask Client, made on first use (after gunicorn's fork), and every call to
the cluster bounded in time: an unreachable scheduler is 503 cluster_unavailable within
a few seconds, never a hung request."""
import os
import threading

from .errors import cluster_unavailable

CONNECT_TIMEOUT_S = 2.0  # connecting, then each call (3 s): a job route answers within 5 s
CALL_TIMEOUT_S = 3.0
DASK_ERRORS = (OSError, TimeoutError)  # distributed's CommClosedError is an OSError

_lock = threading.Lock()
_clients: dict[tuple[int, str], object] = {}  # (pid, address): a forked copy is never reused


def cluster_client(address: str):
    """distributed is imported here, on first use: gunicorn's master, which imports the app
    before forking, never loads it."""
    from distributed import Client

    key = (os.getpid(), address)
    with _lock:
        client = _clients.get(key)
        if client is not None and client.status not in ("closed", "closing"):
            return client
        try:
            client = Client(address, timeout=CONNECT_TIMEOUT_S, set_as_default=False, name="blockgrad")
        except DASK_ERRORS:
            raise cluster_unavailable(address) from None
        _clients[key] = client
        return client


def call(client, coroutine_function, *args, timeout_s: float = CALL_TIMEOUT_S, **kwargs):
    """client.<async method>(*args, **kwargs), cancelled after timeout_s: cluster_unavailable."""
    try:
        return client.sync(coroutine_function, *args, callback_timeout=timeout_s, **kwargs)
    except DASK_ERRORS:
        raise cluster_unavailable(client.scheduler.address) from None


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


def close_clients() -> None:
    with _lock:
        for (pid, _), client in list(_clients.items()):
            if pid == os.getpid():
                client.close(timeout=CALL_TIMEOUT_S)
        _clients.clear()
