"""blockgrad: per-block gradients of pairwise feature matrices, over HTTP."""
from collections.abc import Mapping

from flask import Flask
from flask_smorest import Api

from .auth import install_auth
from .config import Config
from .http_errors import register_error_handlers
from .schemas import ErrorSchema
from .views import gradients, health


class BlockgradApi(Api):
    ERROR_SCHEMA = ErrorSchema  # the OpenAPI document shows our error object


def create_app(config: Mapping | None = None) -> Flask:
    app = Flask(__name__)
    app.config.from_object(Config)
    if config:
        app.config.update(config)
    app.config["MAX_CONTENT_LENGTH"] = app.config["BLOCKGRAD_MAX_BODY_BYTES"]

    install_auth(app)  # one app-level hook: every route, present or future, is behind it
    api = BlockgradApi(app)
    api.register_blueprint(gradients.blp)
    api.register_blueprint(health.blp)
    register_error_handlers(app)  # after Api, which installs its own HTTP error handler
    return app
