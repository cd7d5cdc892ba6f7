"""Optional bearer-token authentication for every route except the probes.

When BLOCKGRAD_API_TOKEN is set, one app-level hook checks
`Authorization: Bearer <token>` before any view runs. The open paths are an
explicit allow-list, so a route added later is protected by default. The token
is compared in constant time and never logged.
"""
import hmac

from flask import Flask, request

from .errors import invalid_token, missing_token

# Probes and metrics stay open so that orchestrators and scrapers need no secret.
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
OPEN_PREFIXES = ("/v2/health/",)
# The documentation, open unless BLOCKGRAD_DOCS_PUBLIC=false: a browser cannot send a bearer token.
DOCS_PATHS = frozenset({"/docs", "/docs/", "/openapi.json"})
DOCS_PREFIXES = ("/docs/assets/",)


def is_open(path: str, docs_public: bool = False) -> bool:
    if docs_public and (path in DOCS_PATHS or path.startswith(DOCS_PREFIXES)):
        return True
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


def bearer_token(header: str) -> bytes | None:
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    # WSGI hands header values over decoded as latin-1: encoding back gives the bytes sent.
    return token.strip().encode("latin-1", "replace")


def install_auth(app: Flask, api_token: str | None, docs_public: bool = True) -> None:
    """Require the token on every non-open path, if one is configured."""
    token = (api_token or "").strip()
    if not token:
        return
    expected = token.encode("utf-8", "surrogateescape")  # a client sends a non-ASCII token as UTF-8

    @app.before_request
    def require_bearer_token():
        if is_open(request.path, docs_public):
            return
        given = bearer_token(request.headers.get("Authorization", ""))
        if given is None:
            raise missing_token()
        if not hmac.compare_digest(given, expected):
            raise invalid_token()
