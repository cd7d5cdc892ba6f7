"""The app's Settings object, kept on the Flask app (one per create_app)."""
from flask import Flask, current_app

from ..core.settings import Settings

EXTENSION = "blockgrad_settings"


def install_settings(app: Flask, settings: Settings) -> None:
    app.extensions[EXTENSION] = settings


def current_settings() -> Settings:
    return current_app.extensions[EXTENSION]
