"""Serving under gunicorn: the worker class, the hooks gunicorn.conf.py names and the helpers they use (docs/serving.md, docs/connections.md)."""
