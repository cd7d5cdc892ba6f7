"""The HTTP layer's settings: the core's, and the fields only app/http reads (the app's
`Services.settings`, app/extensions.py). Read by the core's reader, standard library only."""
from dataclasses import dataclass

from ..core import settings as core


@dataclass(frozen=True)
class Settings(core.Settings):
    # A JSON number can take 2 bytes ("1,"): the body limit bounds the Python objects parsing makes.
    max_body_bytes: int = 32 * 1024 * 1024
    log_level: str = "INFO"
    # Optional bearer token for every route but the probes (app/http/auth.py); None = open.
    api_token: str | None = None
    # With a token set: whether /docs and /openapi.json stay open (a browser sends no token).
    docs_public: bool = True
    send_timeout_s: float = 30.0  # a write making no progress this long ends the request
