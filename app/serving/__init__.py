"""Serving under gunicorn: the hooks gunicorn.conf.py names and the helpers they use (docs/serving.md)."""
