"""The servicer, on each worker's asyncio gRPC server (app/serving/grpc_server.py). Every RPC
is a stream-unary handler whose one request message must arrive within
BLOCKGRAD_READ_TIMEOUT_S, as an HTTP body must: else the call ends DEADLINE_EXCEEDED (code
read_timeout) and frees its place in the cap. The coroutine reads the call's facts (an aio
context is not thread-safe), then the work runs on the loop's threads: ModelInfer runs the one
pipeline (app/http/pipeline.py) with a Call made from those facts, never a Flask request; the
metadata RPCs answer what /v2's routes answer. Every RPC is recorded as an HTTP request is (its
log line, the request metrics with the gRPC method as route and the status's name).
grpc.health.v1 serves Check only (what Kubernetes' gRPC probes call); Watch, and any RPC of
the proto not served here, answer UNIMPLEMENTED (grpcio's answer for a method with no handler).
"""
import asyncio
import hmac
import logging
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace

import grpc
from flask import Flask
from google.protobuf.json_format import ParseDict
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2
from tritonclient.grpc import service_pb2 as pb

from ...core.errors import BlockgradError, invalid_request
from ...extensions import services_of
from ...http import record
from ...http.auth import bearer_token
from ...http.body import reserve_for_request
from ...http.errors import (ERRORS, bounded_error, internal_error, invalid_token, missing_token, model_not_found,
                            read_timeout)
from ...http.pipeline import Call, admit_to_compute, pipeline
from ..health import device_ready
from ..v2.infer import named_as_protocol
from ..v2.model import MODEL_NAME, check_model, model_metadata
from .codec import check_message, decode, render

log = logging.getLogger("blockgrad")
DECODE_COPIES = 3  # the message, its tensor's bytes joined or converted, the (N, D) array

SERVICE = "inference.GRPCInferenceService"
RPCS = {SERVICE: ("ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelInfer"),
        "grpc.health.v1.Health": ("Check",)}
OPEN = ("ServerLive", "ServerReady", "Check")  # no token needed, as for HTTP's probes
ERROR_CODE_KEY = "blockgrad-error-code"  # trailing metadata of every failed call
REQUEST_ID_KEY = "x-request-id"
DEADLINE_MARGIN_S = 0.05
Status = grpc.StatusCode
# The error table's codes (app/http/errors.py) as gRPC statuses: any 4xx code not named is INVALID_ARGUMENT.
STATUS_OF_CODE = {**{code: Status.INVALID_ARGUMENT if 400 <= entry.status < 500 else Status.INTERNAL
                     for code, entry in ERRORS.items()},
                  **dict.fromkeys(("deadline_exceeded", "read_timeout"), Status.DEADLINE_EXCEEDED),
                  **dict.fromkeys(("overloaded", "not_ready", "device_out_of_memory", "cluster_unavailable"),
                                  Status.UNAVAILABLE),
                  **dict.fromkeys(("too_large", "limit_exceeded"), Status.RESOURCE_EXHAUSTED),
                  "unauthorized": Status.UNAUTHENTICATED, "model_not_found": Status.NOT_FOUND,
                  "client_closed": Status.CANCELLED, "internal_error": Status.INTERNAL}


class Servicer:
    def __init__(self, app: Flask, max_message_bytes: int):
        self.app, self.served, self.max_message_bytes = app, services_of(app), max_message_bytes
        self.version, self.read_timeout_s = app.config["API_VERSION"], self.served.settings.read_timeout_s
        token = (self.served.settings.api_token or "").strip()
        self.token = token.encode("utf-8", "surrogateescape") if token else None

    def handlers(self) -> list:
        return [grpc.method_handlers_generic_handler(service, {name: grpc.stream_unary_rpc_method_handler(
            self.handler(f"/{service}/{name}", getattr(self, name))) for name in names})
            for service, names in RPCS.items()]

    def handler(self, route: str, work: Callable) -> Callable:
        async def rpc(requests, context):
            since = record.clock()  # the call's arrival: its duration, span and deadline count from here
            try:
                raw = await asyncio.wait_for(context.read(), self.read_timeout_s)
            except asyncio.TimeoutError:
                raw = None
            if raw is grpc.aio.EOF:  # none sent, or one grpcio refused (over the limit: its own status, sent)
                context.set_trailing_metadata(((ERROR_CODE_KEY, "validation_error"),))
                await context.abort(Status.INVALID_ARGUMENT, "The call ended before its request message.")
            # The call's facts, read here (an aio context is not thread-safe). Ours ends DEADLINE_MARGIN_S
            # before gRPC's, whose end also ends the call: one ended before ours is one its client cancelled.
            remaining, ended = context.time_remaining(), threading.Event()
            due = None if remaining is None else time.monotonic() + remaining - DEADLINE_MARGIN_S
            state = SimpleNamespace(metadata=dict(context.invocation_metadata()), due=due,
                                    cancelled=lambda: ended.is_set() and (due is None or time.monotonic() < due))
            loop = asyncio.get_running_loop()
            done = loop.run_in_executor(None, self.answer, route, work, raw, state, since)
            # Recorded, and its memory given back, once the call ends (a failed one already is), on
            # a pool thread: the log line's write never stalls the loop.
            context.add_done_callback(lambda _: (ended.set(), done.add_done_callback(
                lambda _: loop.run_in_executor(None, state.finish, None))))
            message, error = await asyncio.shield(done)  # a cancelled call's work still ends, on its thread
            context.set_trailing_metadata(((REQUEST_ID_KEY, state.request_id),)
                                          + (((ERROR_CODE_KEY, error.code),) if error else ()))
            if error is not None:
                await context.abort(STATUS_OF_CODE[error.code], bounded_error(error).message)  # those trailers
            return message
        return rpc

    def answer(self, route: str, work: Callable, raw, state, since: tuple) -> tuple:
        """On a pool thread: the call recorded (its id, timing, one log line and the metrics;
        ModelInfer's span, the child of its metadata's traceparent), its token checked (but on
        the probes), and its BlockgradError answered as the table's status, message and code."""
        name, metadata, error, message = route.rsplit("/", 1)[1], state.metadata, None, None
        record.begin(state, record.request_id_from(metadata.get(REQUEST_ID_KEY)), route, "GRPC",
                     metadata if name == "ModelInfer" else None, since)
        try:
            if raw is None:
                raise read_timeout(self.read_timeout_s)
            if name not in OPEN:
                self.authorize(metadata.get("authorization"))
            message = work(raw, state)  # serialised
        except BlockgradError as exc:
            error = exc
        except DecodeError:  # the client's bytes, not the server's failure
            error = invalid_request(f"The request is not a valid {name} message.")
        except Exception:  # noqa: BLE001 - internals go to the log, never the answer
            log.exception("unhandled error")
            error = internal_error()
        state.error_code = None if error is None else error.code
        state.finish = record.finisher("OK" if error is None else STATUS_OF_CODE[error.code].name, state, route, "GRPC")
        if error is not None:
            state.finish(None)
        return message, error

    def authorize(self, header: str | None) -> None:
        given = bearer_token(header or "")
        if self.token is not None and (given is None or not hmac.compare_digest(given, self.token)):
            raise missing_token() if given is None else invalid_token()

    def ServerLive(self, raw, state):
        return pb.ServerLiveResponse(live=True).SerializeToString()

    def ServerReady(self, raw, state):
        return pb.ServerReadyResponse(ready=device_ready(self.served.settings, state)).SerializeToString()

    def ModelReady(self, raw, state):
        message = pb.ModelReadyRequest.FromString(raw)
        check_model(message.name, message.version or None)
        return pb.ModelReadyResponse(ready=device_ready(self.served.settings, state)).SerializeToString()

    def ServerMetadata(self, raw, state):
        return pb.ServerMetadataResponse(name=MODEL_NAME, version=self.version).SerializeToString()

    def ModelMetadata(self, raw, state):
        message = pb.ModelMetadataRequest.FromString(raw)
        check_model(message.name, message.version or None)
        # Every field but `datatypes` (an addition of /v2's)
        return ParseDict(model_metadata(), pb.ModelMetadataResponse(), ignore_unknown_fields=True).SerializeToString()

    def ModelInfer(self, raw, state):
        # The message and its decoding held from here, as an HTTP body is while it arrives; the
        # admission then resizes the reservation to the request's predicted peak.
        reserve_for_request(self.served.ledger, DECODE_COPIES * len(raw), state=state)
        message = pb.ModelInferRequest.FromString(raw)
        check_model(message.model_name, message.model_version or None)
        call = Call(self.served, state, state.cancelled, None if state.due is None else state.due - time.monotonic())

        def admit(sizes, described, _served):
            check_message(sizes, self.max_message_bytes)
            admit_to_compute(sizes, described, call)
        # Fields refused are named as /v2 names them; /v2's schema names the app's objectives.
        with named_as_protocol(), self.app.app_context():
            return render(pipeline(decode(message), call, admit_sizes=admit))

    def Check(self, raw, state):
        """grpc.health.v1: NOT_SERVING while the device is not usable, as /readyz."""
        service = health_pb2.HealthCheckRequest.FromString(raw).service
        if service not in ("", SERVICE):
            raise model_not_found(f"Unknown service {service!r}; this server has '' and {SERVICE!r}.")
        serving = device_ready(self.served.settings, state)
        return health_pb2.HealthCheckResponse(status="SERVING" if serving else "NOT_SERVING").SerializeToString()


def add_services(server, app: Flask, max_message_bytes: int) -> None:
    """The inference service and grpc.health.v1's Check on `server` (a grpc.aio.Server). A
    draining server takes no new call, so health has no draining state of its own."""
    server.add_generic_rpc_handlers(Servicer(app, max_message_bytes).handlers())
