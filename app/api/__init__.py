"""The front ends: thin adapters from HTTP to the core's request and back."""
from flask import Flask
from flask_smorest import Api

from ..extensions import services_of
from ..http.errors import register_error_style
from . import health, metrics, objectives
from .v1 import jobs as v1_jobs
from .v1 import gradients as v1_gradients, schemas as v1_schemas
from .v2 import schemas as v2_schemas, views as v2_views


def register_front_ends(app: Flask, api: Api) -> None:
    api.register_blueprint(v1_gradients.blp)
    api.register_blueprint(v1_jobs.blp)
    api.register_blueprint(objectives.blp)
    api.register_blueprint(health.blp)
    api.register_blueprint(v2_views.blp)
    api.register_blueprint(metrics.blp)
    register_error_style(app, v2_views.blp.url_prefix, v2_views.ERROR_STYLE)
    served = services_of(app).objectives
    v1_schemas.document_objectives(api.spec, served)
    v2_schemas.document_objectives(api.spec, served)
