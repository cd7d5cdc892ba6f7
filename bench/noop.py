"""A no-op WSGI app for the benchmark's floor: reads the body, answers a fixed small JSON.

Served by the same gunicorn command and configuration as the service
(`gunicorn -c gunicorn.conf.py bench.noop:app`), it measures what the server,
the loopback and the client cost with no application at all.
"""
ANSWER = b'{"ok":true}'


def app(environ, start_response):
    environ["wsgi.input"].read()
    start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(ANSWER)))])
    return [ANSWER]
