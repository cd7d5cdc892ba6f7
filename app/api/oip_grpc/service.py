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
from dataclasses import dataclass
from types import SimpleNamespace

import grpc
from flask import Flask
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

SERVICE, HEALTH = "inference.GRPCInferenceService", "grpc.health.v1.Health"
OPEN = ("ServerLive", "ServerReady")  # no token needed, as HTTP's probes
ERROR_CODE_KEY = "blockgrad-error-code"  # trailing metadata of every failed call
REQUEST_ID_KEY = "x-request-id"
DEADLINE_MARGIN_S = 0.05
Status = grpc.StatusCode
# The error table's codes (app/http/errors.py) as gRPC statuses; any other 4xx code is INVALID_ARGUMENT.
STATUS_OF_CODE = {
    "deadline_exceeded": Status.DEADLINE_EXCEEDED, "read_timeout": Status.DEADLINE_EXCEEDED,
    "overloaded": Status.UNAVAILABLE, "not_ready": Status.UNAVAILABLE,
    "device_out_of_memory": Status.UNAVAILABLE, "cluster_unavailable": Status.UNAVAILABLE,
    "unauthorized": Status.UNAUTHENTICATED, "model_not_found": Status.NOT_FOUND,
    "too_large": Status.RESOURCE_EXHAUSTED, "limit_exceeded": Status.RESOURCE_EXHAUSTED,
    "client_closed": Status.CANCELLED, "internal_error": Status.INTERNAL,
}


def status_of(code: str) -> grpc.StatusCode:
    entry = ERRORS.get(code)
    return STATUS_OF_CODE.get(code) or (Status.INVALID_ARGUMENT if entry and 400 <= entry.status < 500
                                        else Status.INTERNAL)


@dataclass(frozen=True)
class Facts:
    """What a call's work needs of it, read in its coroutine."""
    metadata: dict
    due: float | None  # time.monotonic() when our deadline ends: gRPC's, less DEADLINE_MARGIN_S
    ended: threading.Event  # the call is over (answered, cancelled, or past gRPC's deadline)


@dataclass(frozen=True)
class Answer:
    message: bytes | None  # serialised; None when the call fails
    trailing: tuple
    status: grpc.StatusCode | None = None
    details: str = ""
    finish: Callable[[], None] = lambda: None  # records it (and gives its memory back) once the call ends


class Servicer:
    def __init__(self, app: Flask, max_message_bytes: int):
        self.app, self.served, self.max_message_bytes = app, services_of(app), max_message_bytes
        self.version, self.draining = app.config["API_VERSION"], False
        self.read_timeout_s = self.served.settings.read_timeout_s
        token = (self.served.settings.api_token or "").strip()
        self.token = token.encode("utf-8", "surrogateescape") if token else None

    def handlers(self) -> list:
        def unary(service: str, name: str, guarded: bool = True) -> tuple[str, grpc.RpcMethodHandler]:
            return name, grpc.stream_unary_rpc_method_handler(self.handler(f"/{service}/{name}", getattr(self, name),
                                                                           guarded, traced=name == "ModelInfer"))
        served = ("ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelInfer")
        return [grpc.method_handlers_generic_handler(SERVICE, dict(unary(SERVICE, name, name not in OPEN)
                                                                   for name in served)),
                grpc.method_handlers_generic_handler(HEALTH, dict([unary(HEALTH, "Check", guarded=False)]))]

    def handler(self, route: str, work: Callable, guarded: bool, traced: bool) -> Callable:
        async def rpc(requests, context):
            try:
                raw = await asyncio.wait_for(context.read(), self.read_timeout_s)
            except asyncio.TimeoutError:
                raw = None
            remaining, ended = context.time_remaining(), threading.Event()
            facts = Facts(dict(context.invocation_metadata()),
                          None if remaining is None else time.monotonic() + remaining - DEADLINE_MARGIN_S, ended)
            done = asyncio.get_running_loop().run_in_executor(None, self.answer, route, work, raw, facts, guarded,
                                                              traced)
            context.add_done_callback(lambda _: (ended.set(), done.add_done_callback(lambda d: d.result().finish())))
            answer = await asyncio.shield(done)  # a cancelled call's work still ends, recorded, on its thread
            if answer.status is not None:
                await context.abort(answer.status, answer.details, answer.trailing)
            context.set_trailing_metadata(answer.trailing)
            return answer.message
        return rpc

    def answer(self, route: str, work: Callable, raw, facts: Facts, guarded: bool, traced: bool) -> Answer:
        """On a pool thread: the call recorded (its id, timing, one log line and the metrics; a
        span when `traced`, the child of its metadata's traceparent), its token checked when
        `guarded`, and its BlockgradError answered as the table's status, message and code."""
        state, metadata, error = SimpleNamespace(), facts.metadata, None
        record.begin(state, record.request_id_from(metadata.get(REQUEST_ID_KEY)), route, "GRPC",
                     metadata if traced else None)
        try:
            if raw is None:
                raise read_timeout(self.read_timeout_s)
            if raw is grpc.aio.EOF:
                raise invalid_request("The call ended before its request message.")
            if guarded:
                self.authorize(metadata.get("authorization"))
            message = work(raw, facts, state)
        except BlockgradError as exc:
            error = exc
        except Exception:  # noqa: BLE001 - internals go to the log, never the answer
            log.exception("unhandled error")
            error = internal_error()
        trailing = ((REQUEST_ID_KEY, state.request_id),) + (((ERROR_CODE_KEY, error.code),) if error else ())
        if error is None:
            finish = record.finisher("OK", state, route, "GRPC")
            return Answer(message if isinstance(message, bytes) else message.SerializeToString(), trailing,
                          finish=lambda: finish(None))
        state.error_code, status = error.code, status_of(error.code)
        record.finisher(status.name, state, route, "GRPC")(None)
        return Answer(None, trailing, status, bounded_error(error).message)

    def authorize(self, header: str | None) -> None:
        if self.token is None:
            return
        given = bearer_token(header or "")
        if given is None:
            raise missing_token()
        if not hmac.compare_digest(given, self.token):
            raise invalid_token()

    def ServerLive(self, raw, facts, state):
        return pb.ServerLiveResponse(live=True)

    def ServerReady(self, raw, facts, state):
        return pb.ServerReadyResponse(ready=device_ready(self.served.settings, state))

    def ModelReady(self, raw, facts, state):
        message = pb.ModelReadyRequest.FromString(raw)
        check_model(message.name, message.version or None)
        return pb.ModelReadyResponse(ready=device_ready(self.served.settings, state))

    def ServerMetadata(self, raw, facts, state):
        return pb.ServerMetadataResponse(name=MODEL_NAME, version=self.version)

    def ModelMetadata(self, raw, facts, state):
        message = pb.ModelMetadataRequest.FromString(raw)
        check_model(message.name, message.version or None)
        meta = model_metadata()
        tensors = {side: [pb.ModelMetadataResponse.TensorMetadata(name=t["name"], datatype=t["datatype"],
                                                                  shape=t["shape"]) for t in meta[side]]
                   for side in ("inputs", "outputs")}
        return pb.ModelMetadataResponse(name=meta["name"], versions=meta["versions"], platform=meta["platform"],
                                        **tensors)

    def ModelInfer(self, raw, facts, state):
        # The message and its decoding held from here, as an HTTP body is while it arrives; the
        # admission then resizes the reservation to the request's predicted peak.
        reserve_for_request(self.served.ledger, DECODE_COPIES * len(raw), state=state)
        message = pb.ModelInferRequest.FromString(raw)
        check_model(message.model_name, message.model_version or None)
        # Ours ends DEADLINE_MARGIN_S before gRPC's, whose end also ends the call: an ended call
        # is one its client cancelled only before then.
        due = facts.due
        call = Call(self.served, state, lambda: facts.ended.is_set() and (due is None or time.monotonic() < due),
                    None if due is None else due - time.monotonic())

        def admit(sizes, described, _served):
            check_message(sizes, self.max_message_bytes)
            admit_to_compute(sizes, described, call)
        with named_as_protocol():  # fields refused: named as /v2 names them
            with self.app.app_context():  # /v2's schema names the app's objectives; no request context
                described = decode(message)
            return render(pipeline(described, call, admit_sizes=admit))

    def Check(self, raw, facts, state):
        """grpc.health.v1: NOT_SERVING while draining or while the device is not usable, as /readyz."""
        service = health_pb2.HealthCheckRequest.FromString(raw).service
        if service not in ("", SERVICE):
            raise model_not_found(f"Unknown service {service!r}; this server has '' and {SERVICE!r}.")
        serving = not self.draining and device_ready(self.served.settings, state)
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING if serving
                                              else health_pb2.HealthCheckResponse.NOT_SERVING)


def add_services(server, app: Flask, max_message_bytes: int) -> Callable[[], None]:
    """The inference service and grpc.health.v1's Check on `server` (a grpc.aio.Server);
    returns what to call when the worker starts draining (health then answers NOT_SERVING)."""
    servicer = Servicer(app, max_message_bytes)
    server.add_generic_rpc_handlers(servicer.handlers())
    return lambda: setattr(servicer, "draining", True)
