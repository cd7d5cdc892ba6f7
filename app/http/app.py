"""The Flask app's shared HTTP glue: settings, per-worker services, hooks; the front ends are
registered on it by the app factory (app/__init__.py), between `build_app` and `finish_app`."""
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from flask import Flask
from flask_smorest import Api

from ..core.admission import MemoryLedger
from ..core.objectives import served_objectives
from ..core.run import LocalExecutor
from ..core.settings import COMPUTE_SLOTS, environment
from ..core.slots import Gate, SlotSource, ThreadSlots
from ..extensions import Services, install_services
from . import record
from .auth import install_auth
from .docs import ErrorSchema, register_docs, spec_options
from .errors import register_error_handlers
from .settings import Settings

FLASK_CONFIG = {
    "API_TITLE": "blockgrad",
    "API_VERSION": "1.0.0",
    "OPENAPI_VERSION": "3.0.3",
    "OPENAPI_URL_PREFIX": "/",
    "OPENAPI_JSON_PATH": "openapi.json",
    "OPENAPI_SWAGGER_UI_PATH": "docs",
    "OPENAPI_SWAGGER_UI_URL": "/docs/assets/",  # served by docs.py, no CDN; absolute: /docs and /docs/ both work
    "OPENAPI_SWAGGER_UI_CONFIG": {"validatorUrl": None},  # no badge fetched from swagger.io
}


class BlockgradApi(Api):
    ERROR_SCHEMA = ErrorSchema  # the OpenAPI document shows our error object


def build_app(overrides: Mapping[str, Any], slots: SlotSource | None = None,
              jobs: Callable[[Mapping[str, Any]], Any] | None = None,
              scrape_lock: Callable[[], AbstractContextManager] = nullcontext) -> tuple[Flask, Api]:
    """The app with its glue, and the Api its front ends register their blueprints on.
    `slots`: the compute slots (the pod's under gunicorn); None: COMPUTE_SLOTS of this process's own.
    `jobs`: makes the job store from the environment (the overrides included). `scrape_lock`:
    held while /metrics reads the value files."""
    environ = environment(overrides)
    settings = Settings.from_env(environ)
    # Models are loaded and checked here, once per process (in each worker: no preload_app);
    # a file that fails raises ModelError and the service does not start.
    objectives = served_objectives(settings)
    app = Flask("app")
    # werkzeug would answer `/v2//health/live` with a 308 to an absolute URL built from the
    # Host header; without merging such paths are plain 404s.
    app.url_map.merge_slashes = False
    app.config.update(FLASK_CONFIG)
    app.config.update({k: v for k, v in overrides.items() if not k.startswith("BLOCKGRAD_")})
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.config.setdefault("API_SPEC_OPTIONS", spec_options(settings, objectives))
    slots = slots or ThreadSlots(COMPUTE_SLOTS)
    # One executor per worker: a request's chunks over at most BLOCKGRAD_SLOTS_PER_REQUEST of
    # `slots` (default all); its pool has a thread for every slot the worker may hold.
    lanes = max(1, min(settings.slots_per_request or slots.count, slots.count))
    install_services(app, Services(
        settings, objectives, Gate(settings.queue_depth, slots=slots, listener=record.MetricsListener()),
        MemoryLedger(settings.worker_memory_bytes, settings.upload_memory_share),
        LocalExecutor(slots, lanes, threads=max(1, slots.count)), jobs=jobs(environ) if jobs else None,
        scrape_lock=scrape_lock))
    record.configure_logging(settings.log_level)
    # The record's hooks first, so that they see every request.
    app.before_request(record.before_request)
    app.after_request(record.after_request)
    app.teardown_request(record.teardown_request)

    install_auth(app, settings.api_token, settings.docs_public)  # one app-level hook: every route, present or future, is behind it
    return app, BlockgradApi(app)


def finish_app(app: Flask, api: Api) -> Flask:
    """After the front ends: the docs (which read their routes) and the error handlers."""
    register_docs(app, api)
    register_error_handlers(app)  # after Api, which installs its own HTTP error handler
    return app
