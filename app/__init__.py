"""blockgrad: per-block gradients of pairwise feature matrices, over HTTP.

The application factory: the shared HTTP glue (app/http), then the front ends (app/api)
registered on it, then the docs and error handlers that read them. Its imports are inside it, so that importing the
package (e.g. app.core.settings from gunicorn.conf.py) loads neither Flask nor torch.
"""
from collections.abc import Mapping
from typing import Any


def create_app(overrides: Mapping[str, Any] | None = None):
    """The Flask app. `overrides`: BLOCKGRAD_* values over the environment (tests), other keys
    are Flask config (e.g. TESTING)."""
    from .api import register_front_ends
    from .core import host
    from .http import record
    from .http.app import build_app, finish_app
    from .jobs.settings import JobSettings
    from .jobs.store import JobStore

    # The pod's compute slots and the metrics directory's lock, when a server set them (app/core/host.py).
    app, api = build_app(overrides or {}, host.slots, lambda environ: JobStore(JobSettings.from_env(environ)),
                         host.scrape_lock)
    host.on_abort = lambda: record.abort_in_flight(record.WORKER_TIMEOUT)
    host.grpc_services = lambda server, max_message_bytes: grpc_services(server, app, max_message_bytes)
    register_front_ends(app, api)
    return finish_app(app, api)


def grpc_services(server, app, max_message_bytes: int):
    """The gRPC front end on a worker's server: grpcio is imported only here, after the fork."""
    from .api.oip_grpc.service import add_services

    return add_services(server, app, max_message_bytes)
