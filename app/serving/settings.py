"""The serving layer's settings: what only gunicorn.conf.py, the hooks and the worker class
read. Parsed by app/core/settings.py's FromEnv (the same variables' rules; a bad
value raises naming the variable). Standard library only: the master imports it.
"""
import ipaddress
from dataclasses import dataclass, field

from app.core.settings import FromEnv, available_cores


@dataclass(frozen=True)
class ServingSettings(FromEnv):
    # gunicorn's listening address and worker count: one per core, two at most (each computes
    # on the pod's slots). WEB_CONCURRENCY is the name gunicorn itself and platforms such as
    # Heroku use, hence no BLOCKGRAD_ prefix.
    bind: str = "127.0.0.1:8000"
    workers: int = field(default_factory=lambda: min(2, available_cores()), metadata={"env": "WEB_CONCURRENCY"})
    # Idle keep-alive longer than a balancer's usual 60 s: the balancer closes idle connections.
    keepalive_s: float = 75.0
    # The request head must arrive within it, from accept or a kept-alive connection's first new
    # byte (app/serving/worker.py): nothing sent -> closed silently, a partial head -> 408.
    # BLOCKGRAD_READ_TIMEOUT_S (the core's) caps it.
    header_timeout_s: float = 10.0
    # Open connections per worker. Workers x this must hold 1500 + 40 x header_timeout_s: an
    # idle flood of that size leaves room for probes; past it the longest-idle connection
    # without a complete head is closed (docs/connections.md).
    max_connections: int = 1000
    # off: a bind beyond loopback may serve without BLOCKGRAD_API_TOKEN (docs/operations.md).
    auth: bool = True
    # Every worker's gRPC server (app/serving/grpc_server.py); `off` disables it.
    grpc_bind: str = "127.0.0.1:8001"
    # The largest gRPC message either way: a request, or an answer (refused before computing).
    grpc_max_message_bytes: int = 64 * 1024 * 1024


def is_local(address) -> bool:
    """Whether a parsed gunicorn bind address is reachable from this machine only: a unix
    socket or an inherited descriptor (a string, an int), localhost, 127.0.0.0/8 or ::1."""
    if not isinstance(address, tuple) or address[0] == "localhost":
        return True
    try:
        return ipaddress.ip_address(address[0].strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


class NoToken(RuntimeError):
    """gunicorn prints a RuntimeError from on_starting as one line and exits with status 1."""


def check_auth(addresses, settings: ServingSettings, token: str | None, log) -> None:
    """Refuse a bind beyond loopback without a token, unless BLOCKGRAD_AUTH=off said so (then
    warn once)."""
    public = [a for a in addresses if not is_local(a)]
    if not public or token:
        return
    shown = ", ".join(f"{a[0]}:{a[1]}" for a in public)
    if settings.auth:
        raise NoToken(f"refusing to serve {shown} (beyond loopback) without BLOCKGRAD_API_TOKEN: set it, "
                      f"or set BLOCKGRAD_AUTH=off to serve every route to anyone who can connect")
    log.warning("BLOCKGRAD_AUTH=off: serving %s (beyond loopback) without a token: every route is open", shown)
