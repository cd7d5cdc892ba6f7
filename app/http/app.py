"""The Flask app: settings, shared HTTP glue, then each front end's blueprints."""
import os
from collections.abc import Mapping
from typing import Any

from flask import Flask
from flask_smorest import Api

from ..core.registry import build_registry
from ..core.settings import Settings
from . import observe
from .auth import install_auth
from .docs import ErrorSchema, register_docs, spec_options
from .errors import register_error_handlers
from .memory import install_memory_ledger
from .request_log import configure_logging
from .settings import install_objectives, install_settings
from .slot import install_gate

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


def build_app(overrides: Mapping[str, Any]) -> Flask:
    settings = Settings.from_env({**os.environ, **{k: v for k, v in overrides.items() if k.startswith("BLOCKGRAD_")}})
    # Models are loaded and checked here, once per process (in each worker: no preload_app);
    # a file that fails raises ModelError and the service does not start.
    objectives = build_registry(settings)
    app = Flask("app")
    # werkzeug would answer `/v2//health/live` with a 308 to an absolute URL built from the
    # Host header; without merging such paths are plain 404s.
    app.url_map.merge_slashes = False
    app.config.update(FLASK_CONFIG)
    app.config.update({k: v for k, v in overrides.items() if not k.startswith("BLOCKGRAD_")})
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.config.setdefault("API_SPEC_OPTIONS", spec_options(settings, objectives))
    install_settings(app, settings)
    install_gate(app, settings)  # one compute slot and its queue per worker
    install_memory_ledger(app, settings)  # the bytes this worker's requests reserve (app/http/memory.py)
    install_objectives(app, objectives)
    configure_logging(settings.log_level)
    observe.init_app(app)  # first, so that its hooks see every request

    install_auth(app, settings.api_token, settings.docs_public)  # one app-level hook: every route, present or future, is behind it
    api = BlockgradApi(app)
    from ..api import register_front_ends  # the front ends import this package's glue

    register_front_ends(app, api)
    register_docs(app, api, objectives)
    register_error_handlers(app)  # after Api, which installs its own HTTP error handler
    return app
