"""blockgrad: per-block gradients of pairwise feature matrices, over HTTP.

The application factory. Its imports are inside it, so that importing the
package (e.g. app.core.settings from gunicorn.conf.py) loads neither Flask nor torch.
"""
from collections.abc import Mapping
from typing import Any


def create_app(overrides: Mapping[str, Any] | None = None):
    """The Flask app. `overrides`: BLOCKGRAD_* values over the environment (tests), other keys
    are Flask config (e.g. TESTING)."""
    from .http.app import build_app

    return build_app(overrides or {})
