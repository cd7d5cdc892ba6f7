"""Sabotage for tests/test_suite_catches.py: a server that answers 500 internal_error to a
JSON body with an empty row, like main's before issue 27 (`-p tests._sabotage_empty_row`).

In process the body reader fails on such a body; tools/server.py's gunicorn serves
`tests._sabotage_empty_row:app`, the same app with the same fault, instead of wsgi:app.
"""
import json

from app.http import body as parsing
from tools import server

_read_body = parsing.read_body


def read_body(request):
    body = _read_body(request)
    try:
        vectors = json.loads(body).get("vectors")
    except (ValueError, AttributeError, UnicodeDecodeError):
        return body
    if isinstance(vectors, list) and any(row == [] for row in vectors):
        raise ZeroDivisionError("sabotage: an empty row reaches the memory model")
    return body


parsing.read_body = read_body  # looked up per request by the front ends' decoders

_command = server.gunicorn_command


def gunicorn_command(app: str = "wsgi:app") -> list[str]:
    return _command("tests._sabotage_empty_row:app" if app == "wsgi:app" else app)


server.gunicorn_command = gunicorn_command


def __getattr__(name):
    if name == "app":  # in a gunicorn worker: wsgi's app, served with the fault above
        from wsgi import app
        return app
    raise AttributeError(name)
