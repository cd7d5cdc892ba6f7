"""The app's Settings and objective registry, kept on the Flask app (one of each per create_app)."""
from collections.abc import Mapping

from flask import Flask, current_app

from ..core.objectives import Objective
from ..core.settings import Settings

EXTENSION = "blockgrad_settings"
OBJECTIVES_EXTENSION = "blockgrad_objectives"


def install_settings(app: Flask, settings: Settings) -> None:
    app.extensions[EXTENSION] = settings


def current_settings() -> Settings:
    return current_app.extensions[EXTENSION]


def install_objectives(app: Flask, objectives: Mapping[str, Objective]) -> None:
    app.extensions[OBJECTIVES_EXTENSION] = objectives


def current_objectives() -> Mapping[str, Objective]:
    """This server's objectives: the built-ins and the models of BLOCKGRAD_MODEL_DIR."""
    return current_app.extensions[OBJECTIVES_EXTENSION]
