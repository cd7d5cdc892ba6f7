"""Traces: OpenTelemetry's SDK set up once in each process that makes spans (a gunicorn worker
after the fork, a Dask worker at its first traced task), only when OTEL_EXPORTER_OTLP_ENDPOINT or
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set. Off, no provider is set, `TRACER` stays None and the
span code does nothing. The SDK reads the other OTEL_* variables itself (the exporter's
endpoint, headers and timeout, the batch processor's OTEL_BSP_*). A layer-free leaf: the
HTTP glue, serving and the job tasks import it; it imports only opentelemetry
(docs/operations.md, "Traces")."""
import os
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

ENDPOINTS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
TRACER: trace.Tracer | None = None
PROCESSOR = None  # the batch processor
DROPPED = lambda: None  # noqa: E731 - called per span a full queue drops (record.count_dropped_spans: a Prometheus counter's inc)
PROPAGATOR = TraceContextTextMapPropagator()


def configure(environ: Mapping[str, str] = os.environ) -> bool:
    """Set this process's tracer provider (once) when an endpoint is set; whether tracing is on."""
    global TRACER, PROCESSOR
    if TRACER is not None or not any(environ.get(name) for name in ENDPOINTS):
        return TRACER is not None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    protocol = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:  # http/protobuf, the default
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    created = Resource.create({"service.name": environ.get("OTEL_SERVICE_NAME") or "blockgrad",
                               "process.pid": os.getpid()})
    hashed = hash(created)  # once: the exporter hashes every span's resource, which the SDK dumps to JSON each time
    resource = type("HashedOnce", (Resource,), {"__hash__": lambda _: hashed})(created.attributes, created.schema_url)
    provider = TracerProvider(resource=resource)
    PROCESSOR = batch_processor(OTLPSpanExporter())
    provider.add_span_processor(PROCESSOR)
    trace.set_tracer_provider(provider)
    TRACER = provider.get_tracer("blockgrad")
    return True


def batch_processor(exporter, **options):
    """The SDK's batch processor (a bounded queue, OTEL_BSP_*, a thread that exports), which
    counts (DROPPED) the spans it drops when its queue is full (the SDK only logs them)."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    class CountingProcessor(BatchSpanProcessor):
        def on_end(self, span) -> None:
            queue = self._batch_processor._queue  # noqa: SLF001 - the pinned SDK's bounded deque
            if span.context.trace_flags.sampled and len(queue) >= queue.maxlen:
                DROPPED()
            super().on_end(span)

    return CountingProcessor(exporter, **options)


def parent(carrier: Mapping[str, str]):
    """The context a W3C traceparent in `carrier` (headers, gRPC metadata) names; none: a new trace."""
    return PROPAGATOR.extract(carrier) if "traceparent" in carrier else None  # (bool(headers) counts them)


def current_traceparent() -> str | None:
    """The W3C traceparent of the current span (None: none), to carry into a job's tasks."""
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier)
    return carrier.get("traceparent")


def end_stages(server, stages: list[tuple[str, int, dict | None]], end_ns: int, outcome: str | None) -> None:
    """The request's stage spans, children of its (recording) server span, made at its end from
    `stages` (name, start, attributes): each ends where the next starts, the last at `end_ns`
    with the outcome when there is one (where the request stopped). Handed to the processor as
    the finished spans the SDK itself makes at a span's end: its per-span machinery (sampler,
    limits, locks, context) costs ten times as much, and they follow the server span's sampling."""
    from opentelemetry.sdk.trace import ReadableSpan

    parent, new_id = server.get_span_context(), TRACER.id_generator.generate_span_id
    for i, (name, start, attributes) in enumerate(stages):
        last = i + 1 == len(stages)
        if last and outcome:
            attributes = {**(attributes or {}), "blockgrad.outcome": outcome}
        context = trace.SpanContext(parent.trace_id, new_id(), False, parent.trace_flags, parent.trace_state)
        PROCESSOR.on_end(ReadableSpan(name, context, parent, server.resource, attributes, start_time=start,
                                      end_time=end_ns if last else stages[i + 1][1],
                                      instrumentation_scope=server.instrumentation_scope))
