"""The front ends: thin adapters from HTTP to the core's request and back."""
from flask import Flask
from flask_smorest import Api

from ..extensions import services_of
from . import health, metrics, objectives
from .v1 import jobs as v1_jobs
from .v1 import gradients as v1_gradients, schemas as v1_schemas
from .v2 import schemas as v2_schemas, views as v2_views


def register_front_ends(app: Flask, api: Api) -> None:
    for front_end in (v1_gradients, v1_jobs, objectives, health, v2_views, metrics):  # the document's order
        api.register_blueprint(front_end.blp)
    # Errors of requests under /v2 (matched or not) take the protocol's style.
    services_of(app).error_styles[v2_views.blp.url_prefix] = v2_views.ERROR_STYLE
    served = services_of(app).objectives
    v1_schemas.document_objectives(api.spec, served)
    v2_schemas.document_objectives(api.spec, served)
