"""Where the app and the server hosting it meet without importing each other (core sits below
both). gunicorn's hooks (app/serving/hooks.py) set the pod's compute slots and the metrics
scrape lock before the app is built; the app factory (app/__init__.py) reads them and sets
what the server calls when gunicorn aborts a worker. Left unset (tests, a development
server): the app's own slots, no lock, nothing to call. Standard library only."""
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from .slots import SlotSource

# environ key: when the request's clock started (time.monotonic(): accept, or a kept-alive connection's
# first new byte), set by the worker class (app/serving/worker.py); the body's read alarm counts from it.
CONN_STARTED_KEY = "blockgrad.conn_started"

slots: SlotSource | None = None  # the pod's, shared by every worker
scrape_lock: Callable[[], AbstractContextManager] = nullcontext  # held while /metrics reads the value files
# Set by the app factory: (grpc server, max message bytes) -> the servicers added (app/serving/grpc_server.py).
grpc_services: Callable[[Any, int], None] | None = None


def on_abort() -> None:
    """Replaced by the app factory: log the requests still in flight of a worker gunicorn aborts."""
