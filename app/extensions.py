"""The per-worker services, built once per app by the factory and kept on it in one place.

Flask's `app.extensions` holds them under one key; `services()` is how request code reads
them, `services_of(app)` how a test or a hook outside a request does.
"""
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from flask import Flask, current_app

from .core.admission import MemoryLedger
from .core.objectives import Objective
from .core.run import Executor
from .core.slots import Gate
from .http.settings import Settings

KEY = "blockgrad"


@dataclass(frozen=True)
class Services:
    settings: Settings
    objectives: Mapping[str, Objective]  # built-ins, then the models of BLOCKGRAD_MODEL_DIR
    gate: Gate  # the compute slots (the pod's, or this process's) and this worker's queue for them
    ledger: MemoryLedger  # the bytes this worker's requests reserve
    executor: Executor  # runs a request's chunks over the free slots (one pool per worker)
    # URL prefix -> how errors under it look (app/http/errors.py's ErrorStyle), by front end.
    error_styles: dict[str, object] = field(default_factory=dict)
    # The job store: app/jobs/store.py's JobStore, built by the app factory (this module does not
    # import the jobs layer); it opens its database at the first job route or scrape.
    jobs: Any = None
    # Held while /metrics reads every worker's value files (under gunicorn, against the master's folds).
    scrape_lock: Callable[[], AbstractContextManager] = nullcontext


def install_services(app: Flask, services: Services) -> None:
    app.extensions[KEY] = services


def services_of(app: Flask) -> Services:
    return app.extensions[KEY]


def services() -> Services:
    """The current app's services (inside a request or an app context)."""
    return current_app.extensions[KEY]
