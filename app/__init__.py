"""blockgrad: per-block gradients of pairwise feature matrices, over HTTP."""
from collections.abc import Mapping

from flask import Flask
from flask_smorest import Api

from . import observe
from .auth import install_auth
from .config import Config
from .docs import register_docs, spec_options
from .http_errors import register_error_handlers
from .request_log import configure_logging
from .schemas import ErrorSchema
from .v2.views import blp as v2_blueprint
from .views import gradients, health, metrics


class BlockgradApi(Api):
    ERROR_SCHEMA = ErrorSchema  # the OpenAPI document shows our error object


def create_app(config: Mapping | None = None) -> Flask:
    app = Flask(__name__)
    app.config.from_object(Config)
    if config:
        app.config.update(config)
    app.config["MAX_CONTENT_LENGTH"] = app.config["BLOCKGRAD_MAX_BODY_BYTES"]
    app.config.setdefault("API_SPEC_OPTIONS", spec_options(app.config))
    configure_logging(app.config["BLOCKGRAD_LOG_LEVEL"])
    observe.init_app(app)  # first, so that its hooks see every request

    install_auth(app)  # one app-level hook: every route, present or future, is behind it
    api = BlockgradApi(app)
    api.register_blueprint(gradients.blp)
    api.register_blueprint(health.blp)
    api.register_blueprint(v2_blueprint)
    api.register_blueprint(metrics.blp)
    register_docs(app, api)
    register_error_handlers(app)  # after Api, which installs its own HTTP error handler
    return app
