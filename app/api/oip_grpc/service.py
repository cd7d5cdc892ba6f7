"""The servicer: ModelInfer runs the one pipeline (app/http/pipeline.py) with a Call made
from the gRPC context, never a Flask request; the metadata and health RPCs answer what /v2's
routes answer. Every RPC is recorded as an HTTP request is (its log line, the request metrics
with the gRPC method as route and the status's name). RPCs of the proto not served here
answer UNIMPLEMENTED (the generated base servicer's).
"""
import hmac
import logging
import time
from collections.abc import Callable
from types import SimpleNamespace

import grpc
from flask import Flask
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2 as pb, service_pb2_grpc as pb_grpc

from ...core.errors import BlockgradError
from ...extensions import services_of
from ...http import record
from ...http.auth import bearer_token
from ...http.body import reserve_for_request
from ...http.errors import ERRORS, bounded_error, internal_error, invalid_token, missing_token
from ...http.pipeline import Call, admit_to_compute, pipeline
from ..v2.infer import field_messages, invalid
from ..v2.model import MODEL_NAME, model_metadata
from ..v2.views import check_model, device_ready
from .codec import check_message, decode, render

log = logging.getLogger("blockgrad")
DECODE_COPIES = 3  # the message, its tensor's bytes joined or converted, the (N, D) array

SERVICE = "inference.GRPCInferenceService"
ERROR_CODE_KEY = "blockgrad-error-code"  # trailing metadata of every failed call
REQUEST_ID_KEY = "x-request-id"
DEADLINE_MARGIN_S = 0.05
Status = grpc.StatusCode
# The error table's codes (app/http/errors.py) as gRPC statuses; any other 4xx code is INVALID_ARGUMENT.
STATUS_OF_CODE = {
    "deadline_exceeded": Status.DEADLINE_EXCEEDED, "overloaded": Status.UNAVAILABLE, "not_ready": Status.UNAVAILABLE,
    "device_out_of_memory": Status.UNAVAILABLE, "cluster_unavailable": Status.UNAVAILABLE,
    "unauthorized": Status.UNAUTHENTICATED, "model_not_found": Status.NOT_FOUND,
    "too_large": Status.RESOURCE_EXHAUSTED, "limit_exceeded": Status.RESOURCE_EXHAUSTED,
    "client_closed": Status.CANCELLED, "internal_error": Status.INTERNAL,
}


def status_of(code: str) -> grpc.StatusCode:
    entry = ERRORS.get(code)
    return STATUS_OF_CODE.get(code) or (Status.INVALID_ARGUMENT if entry and 400 <= entry.status < 500
                                        else Status.INTERNAL)


def recorded(name: str, guarded: bool = True, traced: bool = False) -> Callable:
    """An RPC recorded (its id, timing, one log line and the metrics; a span when `traced`, the
    child of its metadata's traceparent), its token checked when `guarded`, and its BlockgradError answered as the table's status, message and code."""
    route = f"/{SERVICE}/{name}"

    def wrap(method):
        def rpc(self, message, context):
            state, metadata = SimpleNamespace(), dict(context.invocation_metadata())
            record.begin(state, record.request_id_from(metadata.get(REQUEST_ID_KEY)), route, "GRPC",
                         metadata if traced else None)
            error = None
            try:
                if guarded:
                    self.authorize(metadata.get("authorization"))
                answer = method(self, message, context, state)
            except BlockgradError as exc:
                error = exc
            except Exception:  # noqa: BLE001 - internals go to the log, never the answer
                log.exception("unhandled error")
                error = internal_error()
            context.set_trailing_metadata(((REQUEST_ID_KEY, state.request_id),)
                                          + (((ERROR_CODE_KEY, error.code),) if error else ()))
            if error is None:  # recorded, and its memory given back, once the answer is sent (or the call ends)
                finish = record.finisher("OK", state, route, "GRPC")
                if not context.add_callback(lambda: finish(None)):
                    finish(None)
                return answer
            state.error_code, status = error.code, status_of(error.code)
            record.finisher(status.name, state, route, "GRPC")(None)
            context.abort(status, bounded_error(error).message)
        return rpc
    return wrap


class Servicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, app: Flask, max_message_bytes: int):
        self.app, self.served, self.max_message_bytes = app, services_of(app), max_message_bytes
        self.version = app.config["API_VERSION"]
        token = (self.served.settings.api_token or "").strip()
        self.token = token.encode("utf-8", "surrogateescape") if token else None

    def authorize(self, header: str | None) -> None:
        if self.token is None:
            return
        given = bearer_token(header or "")
        if given is None:
            raise missing_token()
        if not hmac.compare_digest(given, self.token):
            raise invalid_token()

    @recorded("ServerLive", guarded=False)
    def ServerLive(self, message, context, state):
        return pb.ServerLiveResponse(live=True)

    @recorded("ServerReady", guarded=False)
    def ServerReady(self, message, context, state):
        return pb.ServerReadyResponse(ready=device_ready(self.served.settings, state))

    @recorded("ModelReady")
    def ModelReady(self, message, context, state):
        check_model(message.name, message.version or None)
        return pb.ModelReadyResponse(ready=device_ready(self.served.settings, state))

    @recorded("ServerMetadata")
    def ServerMetadata(self, message, context, state):
        return pb.ServerMetadataResponse(name=MODEL_NAME, version=self.version)

    @recorded("ModelMetadata")
    def ModelMetadata(self, message, context, state):
        check_model(message.name, message.version or None)
        meta = model_metadata()
        tensors = {side: [pb.ModelMetadataResponse.TensorMetadata(name=t["name"], datatype=t["datatype"],
                                                                  shape=t["shape"]) for t in meta[side]]
                   for side in ("inputs", "outputs")}
        return pb.ModelMetadataResponse(name=meta["name"], versions=meta["versions"], platform=meta["platform"],
                                        **tensors)

    @recorded("ModelInfer", traced=True)
    def ModelInfer(self, message, context, state):
        check_model(message.model_name, message.model_version or None)
        # Ours ends DEADLINE_MARGIN_S before gRPC's, whose end also makes the call inactive: an
        # inactive call is one its client cancelled only before then.
        remaining = context.time_remaining()
        due = None if remaining is None else time.monotonic() + remaining - DEADLINE_MARGIN_S
        call = Call(self.served, state, lambda: not context.is_active() and (due is None or time.monotonic() < due),
                    None if remaining is None else remaining - DEADLINE_MARGIN_S)

        def admit(sizes, described, _served):
            check_message(sizes, self.max_message_bytes)
            admit_to_compute(sizes, described, call)
        # The message and its decoding held from here, as an HTTP body is while it arrives; the
        # admission then resizes the reservation to the request's predicted peak.
        reserve_for_request(self.served.ledger, DECODE_COPIES * message.ByteSize(), state=state)
        try:
            with self.app.app_context():  # /v2's schema names the app's objectives; no request context
                described = decode(message)
            return render(pipeline(described, call, admit_sizes=admit))
        except BlockgradError as exc:  # fields refused: named as /v2 names them
            if exc.code == "validation_error" and isinstance(exc.details.get("fields"), dict):
                raise invalid(field_messages(exc.details["fields"])) from None
            raise


class Health(health.HealthServicer):
    """grpc.health.v1: Check (what Kubernetes' gRPC probes call) answers NOT_SERVING while the
    device is not usable, as /readyz does. A Watch holds one of the capped calls while it lasts."""

    def __init__(self, settings):
        super().__init__(experimental_non_blocking=False)
        self.settings = settings

    def Check(self, request, context):
        answer = super().Check(request, context)
        if answer.status == health_pb2.HealthCheckResponse.SERVING and not device_ready(self.settings,
                                                                                         SimpleNamespace()):
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.NOT_SERVING)
        return answer


def add_services(server: grpc.Server, app: Flask, max_message_bytes: int) -> Callable[[], None]:
    """The inference service and grpc.health.v1 on `server`; returns what to call when the
    worker starts draining (health then answers NOT_SERVING)."""
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(Servicer(app, max_message_bytes), server)
    checker = Health(services_of(app).settings)
    for name in ("", SERVICE):
        checker.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    return checker.enter_graceful_shutdown
