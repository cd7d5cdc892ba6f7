"""The server side of the service: the gunicorn worker class and what it needs after fork."""
