"""Each gunicorn worker's gRPC server, beside its HTTP one (docs/operations.md, "gRPC").

Started in post_worker_init, after the fork and the warm-up, before the worker accepts HTTP:
grpcio is never imported in the master, since a process forked from one whose gRPC threads
hold locks inherits the locks without the threads. Every worker binds BLOCKGRAD_GRPC_BIND with
SO_REUSEPORT (grpcio's default on Linux, set here explicitly), so the kernel spreads new
connections over the workers as it does HTTP's accepts, and a recycled worker's replacement
binds the same port. The master probes the address first without SO_REUSEPORT, so a port
held by anything else, another blockgrad included, stops the start naming the variable.
The servicers come from the app (app/core/host.py's `grpc_services`, set by the factory).
The server is grpcio's asyncio one, on its own loop thread: a call's coroutine can give up
waiting for the request message (grpcio's thread-pool server blocks a thread on it with no
bound), and the work runs on the loop's default executor, `threads` threads.
"""
import asyncio
import threading
from concurrent import futures
from dataclasses import dataclass
from typing import Any

from gunicorn.util import parse_address

from app.core import host

from . import addresses
from .settings import ServingSettings, check_auth

BIND_VARIABLE = "BLOCKGRAD_GRPC_BIND"
# Clients may ping without data no more often than this; two strikes and the connection is closed.
MIN_PING_INTERVAL_MS = 60_000
# Long-lived HTTP/2 connections never rebalance over a Service's pods: each is closed (GOAWAY)
# after this age, its calls given the grace to finish.
MAX_CONNECTION_AGE_MS = 300_000


def check_address(settings: ServingSettings, http: list, token: str | None, log) -> None:
    """In the master before any fork: the token rule of BLOCKGRAD_BIND, then a free port, not
    HTTP's (`http`: gunicorn's parsed bind, not bound yet)."""
    if settings.grpc_bind.strip().lower() != "off":
        address = [parse_address(settings.grpc_bind, 8001)]
        check_auth(address, settings, token, log)
        if address[0] in http:
            raise addresses.AddressInUse(f"cannot listen on {settings.grpc_bind} for gRPC: BLOCKGRAD_BIND has it "
                                         f"(set {BIND_VARIABLE} to another port, or off)")
        addresses.refuse_if_taken(address, reuse_port=False, variable=BIND_VARIABLE)


def options(settings: ServingSettings, grace_s: float) -> list[tuple[str, Any]]:
    size = settings.grpc_max_message_bytes
    return [("grpc.so_reuseport", 1), ("grpc.max_send_message_length", size), ("grpc.max_receive_message_length", size),
            ("grpc.keepalive_permit_without_calls", 0), ("grpc.http2.max_ping_strikes", 2),
            ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
            ("grpc.max_connection_idle_ms", int(settings.keepalive_s * 1000)),
            ("grpc.max_connection_age_ms", MAX_CONNECTION_AGE_MS),
            ("grpc.max_connection_age_grace_ms", int(grace_s * 1000))]


@dataclass
class Running:
    stop: Any  # schedules the server's stop on its loop (run by its own thread): a future
    grace_s: float
    stopped: Any = None  # the stop's future, once stopping

    def drain(self) -> None:
        """Stop accepting calls (a new one is refused, UNAVAILABLE on a connection already open);
        calls in flight get grace_s. Never blocks: called from the worker's SIGTERM handler too."""
        if self.stopped is None:
            self.stopped = self.stop()

    def wait(self) -> None:
        self.drain()
        futures.wait([self.stopped], self.grace_s + 5)


def start(settings: ServingSettings, threads: int, grace_s: float) -> Running | None:
    """The worker's server, serving before this returns; None when BLOCKGRAD_GRPC_BIND is off.
    `threads`: its pool, and the calls it takes at once (past it RESOURCE_EXHAUSTED at once)."""
    if settings.grpc_bind.strip().lower() == "off" or host.grpc_services is None:
        return None
    import grpc  # after the fork: see the module's docstring

    loop = asyncio.new_event_loop()
    loop.set_default_executor(futures.ThreadPoolExecutor(threads, thread_name_prefix="grpc"))
    threading.Thread(target=loop.run_forever, name="grpc-loop", daemon=True).start()

    async def serve():
        server = grpc.aio.server(options=options(settings, grace_s), maximum_concurrent_rpcs=threads)
        host.grpc_services(server, settings.grpc_max_message_bytes)
        try:
            server.add_insecure_port(settings.grpc_bind)
        except RuntimeError:  # grpcio 1.85 raises on a failed bind
            raise addresses.AddressInUse(f"cannot listen on {settings.grpc_bind} for gRPC (set {BIND_VARIABLE} to a "
                                         "free host:port, or off)") from None
        await server.start()
        return Running(lambda: asyncio.run_coroutine_threadsafe(server.stop(grace_s), loop), grace_s)
    return asyncio.run_coroutine_threadsafe(serve(), loop).result()
