"""OTLP trace receivers on loopback for the tests, over HTTP (`Receiver`) or gRPC
(`GrpcReceiver`): each decodes the export requests (ExportTraceServiceRequest,
opentelemetry-proto's classes) and keeps their spans with their resource's attributes."""
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                     ExportTraceServiceResponse)

from tools.server import wait_until


@dataclass(frozen=True)
class Received:
    resource: dict  # the resource's attributes (service.name, process.pid...)
    span: object  # opentelemetry.proto.trace.v1.Span

    @property
    def name(self) -> str:
        return self.span.name

    def attribute(self, key: str):
        for pair in self.span.attributes:
            if pair.key == key:
                return getattr(pair.value, pair.value.WhichOneof("value"))
        return None


def plain(value):
    return getattr(value, value.WhichOneof("value"))


class Receiver:
    def __init__(self, port: int = 0):
        self.spans: list[Received] = []
        self.requests = 0
        self.lock = lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.keep(ExportTraceServiceRequest.FromString(body))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def keep(self, message: ExportTraceServiceRequest) -> None:
        with self.lock:
            self.requests += 1
            for resource_spans in message.resource_spans:
                resource = {pair.key: plain(pair.value) for pair in resource_spans.resource.attributes}
                self.spans.extend(Received(resource, span) for scope in resource_spans.scope_spans
                                  for span in scope.spans)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def of_trace(self, trace_id: str) -> list[Received]:
        return [got for got in list(self.spans) if got.span.trace_id.hex() == trace_id]

    def wait_for(self, trace_id: str, names: set[str], timeout_s: float = 60) -> list[Received]:
        """The trace's spans once every name in `names` has arrived; bounded."""
        arrived = lambda: names <= {got.name for got in self.of_trace(trace_id)}  # noqa: E731
        assert wait_until(arrived, timeout_s, 0.1), \
            f"spans of {trace_id}: {sorted(got.name for got in self.of_trace(trace_id))}, wanted {sorted(names)}"
        return self.of_trace(trace_id)


class GrpcReceiver(Receiver):
    """The same, as OTLP/gRPC's TraceService (grpcio, the collector's generated stubs)."""

    def __init__(self, port: int = 0):
        from concurrent.futures import ThreadPoolExecutor

        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

        self.spans, self.requests, self.lock, receiver = [], 0, threading.Lock(), self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                receiver.keep(request)
                return ExportTraceServiceResponse()

        self.server = grpc.server(ThreadPoolExecutor(2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.server)
        bound = self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.endpoint = f"http://127.0.0.1:{bound}"
        self.server.start()

    def close(self) -> None:
        self.server.stop(None)
