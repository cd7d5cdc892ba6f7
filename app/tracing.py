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
ReadableSpan = None  # the SDK's, for the spans made as finished ones (RequestSpan), from configure() on
# W3C traceparent alone: opentelemetry.propagate would read OTEL_PROPAGATORS at import and fail
# the service's start, tracing off or not, on a format it does not have (b3).
PROPAGATOR = TraceContextTextMapPropagator()
DROPPED = lambda amount=1: None  # noqa: E731 - given the spans a full queue drops (app/http/record.py counts them)


def configure(environ: Mapping[str, str] = os.environ) -> bool:
    """Set this process's tracer provider (once) when an endpoint is set (and the SDK not disabled);
    whether tracing is on."""
    global TRACER, PROCESSOR, ReadableSpan
    wanted = any(environ.get(name) for name in ENDPOINTS) and environ.get("OTEL_SDK_DISABLED", "").lower() != "true"
    if TRACER is not None or not wanted:
        return TRACER is not None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

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
    PROCESSOR = BatchSpanProcessor(OTLPSpanExporter())
    provider.add_span_processor(PROCESSOR)
    trace.set_tracer_provider(provider)
    TRACER = provider.get_tracer("blockgrad")
    return True


def hand_over(spans: list) -> None:
    """Queue finished, sampled spans in the batch processor; those its full queue pushes out are
    counted (DROPPED) at once: the SDK only logs them. (A Dask worker's task spans are the SDK's
    own: their drops are logged only.)"""
    queue, dropped = PROCESSOR._batch_processor._queue, 0  # noqa: SLF001 - the pinned SDK's bounded deque
    for span in spans:
        dropped += len(queue) == queue.maxlen  # the SDK's own test, just before it drops the oldest
        PROCESSOR.on_end(span)
    if dropped:
        DROPPED(dropped)


class RequestSpan:
    """A request's server span, made as a finished span at its end like its stages (`end`): the
    SDK's sampler and ids decide it at the start, as start_span does, without the SDK's live span
    (its attribute locks, limits and processors cost several times as much). `recording`: sampled;
    `attributes` grow until the end."""

    def __init__(self, name: str, carrier: Mapping[str, str], start_ns: int, attributes: dict):
        """`carrier` (headers, gRPC metadata): its W3C traceparent is the parent; none: a new trace."""
        context = PROPAGATOR.extract(carrier) if carrier.get("traceparent") else None  # (`in` walks werkzeug's headers)
        above, ids = trace.get_current_span(context).get_span_context(), TRACER.id_generator
        trace_id, self.parent = (above.trace_id, above) if above.is_valid else (ids.generate_trace_id(), None)
        sampled = TRACER.sampler.should_sample(context, trace_id, name, trace.SpanKind.SERVER, attributes)
        random = self.parent.trace_flags.random_trace_id if self.parent else ids.is_trace_id_random()  # as start_span
        flags = trace.TraceFlags(int(sampled.decision.is_sampled()) | int(random) << 1)  # SAMPLED 1, RANDOM_TRACE_ID 2
        self.context = trace.SpanContext(trace_id, ids.generate_span_id(), False, flags, sampled.trace_state)
        self.name, self.start_time, self.recording = name, start_ns, sampled.decision.is_sampled()
        self.attributes = {**attributes, **(sampled.attributes or {})}

    def end(self, stages: list[tuple[str, int, dict | None]], end_ns: int, status: int | str, outcome: str | None):
        """The span, with the answer's `status` and `outcome` (the error code if any), and its stages'
        (`stages`: name, start, attributes; each ends where the next starts, the last at `end_ns`
        with the outcome when there is one, where the request stopped), handed to the processor at
        once as the finished spans the SDK makes at a span's end, with the tracer's own scope."""
        if not self.recording:
            return
        context, new_id, scope = self.context, TRACER.id_generator.generate_span_id, TRACER._instrumentation_scope
        answered = trace.Status(trace.StatusCode.ERROR, outcome) if outcome else trace.Status()
        spans = [ReadableSpan(self.name, context, self.parent, TRACER.resource,
                              {**self.attributes, "blockgrad.status": status, "blockgrad.outcome": outcome or "ok"},
                              kind=trace.SpanKind.SERVER, status=answered, start_time=self.start_time, end_time=end_ns,
                              instrumentation_scope=scope)]
        for i, (name, start, attributes) in enumerate(stages):
            last = i + 1 == len(stages)
            if last and outcome:
                attributes = {**(attributes or {}), "blockgrad.outcome": outcome}
            own = trace.SpanContext(context.trace_id, new_id(), False, context.trace_flags, context.trace_state)
            spans.append(ReadableSpan(name, own, context, TRACER.resource, attributes, start_time=start,
                                      end_time=end_ns if last else stages[i + 1][1], instrumentation_scope=scope))
        hand_over(spans)


def current_traceparent() -> str | None:
    """The W3C traceparent of the current span (None: none), to carry into a job's tasks."""
    context = trace.get_current_span().get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}" if context.is_valid else None
