"""app/tracing.py in this process, without a server: off unless an OTLP endpoint is set (and the
SDK not disabled), a request's span decided as the SDK's start_span decides one, and the spans a
full queue drops counted (an exporter held at a known point)."""
import os
import subprocess
import sys
import threading
from pathlib import Path

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExportResult

import app.tracing as tracing


def test_off_without_an_endpoint_sets_no_provider():
    assert tracing.configure({"OTEL_SERVICE_NAME": "x", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}) is False
    assert tracing.configure({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_SDK_DISABLED": "True"}) is False
    assert tracing.TRACER is None and tracing.PROCESSOR is None
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


def test_a_propagator_set_for_other_services_does_not_stop_the_service():
    """OTEL_PROPAGATORS naming a format not installed (b3): the app still imports, tracing off."""
    environ = {**os.environ, "OTEL_PROPAGATORS": "b3"}
    started = subprocess.run([sys.executable, "-c", "import app.tracing, app.http.record"], env=environ,
                             cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stderr


def test_a_request_span_is_decided_as_the_sdks_start_span_decides_and_handed_over_with_its_stages(monkeypatch):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    exporter, provider = InMemorySpanExporter(), TracerProvider()
    tracer = provider.get_tracer("test")
    for name, value in (("TRACER", tracer), ("ReadableSpan", ReadableSpan), ("PROCESSOR", BatchSpanProcessor(exporter))):
        monkeypatch.setattr(tracing, name, value)
    caller = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-0{}"
    for carrier in ({}, {"traceparent": caller.format(1)}, {"traceparent": caller.format(3)}):
        ours = tracing.RequestSpan("POST /v1/gradients", carrier, 5, {"blockgrad.request_id": "r"})
        theirs = tracer.start_span("x", TraceContextTextMapPropagator().extract(carrier) if carrier else None)
        theirs = theirs.get_span_context()
        assert ours.context.trace_flags == theirs.trace_flags and ours.recording
        assert (ours.context.trace_id == theirs.trace_id) == bool(carrier)
        ours.end([("decode", 5, None), ("admit", 7, {"a": 1})], 9, 422, "validation_error")
    unsampled = tracing.RequestSpan("POST /v1/gradients", {"traceparent": caller.format(0)}, 5, {})
    assert not unsampled.recording and unsampled.context.trace_flags == 0
    unsampled.end([("decode", 5, None)], 9, 200, None)
    assert tracing.PROCESSOR.force_flush(60_000)
    spans = exporter.get_finished_spans()
    assert [span.name for span in spans] == ["POST /v1/gradients", "decode", "admit"] * 3
    server, decode, admit = spans[-3:]
    assert server.parent.span_id == 0xB7AD6B7169203331 and server.kind == trace.SpanKind.SERVER
    assert (server.status.status_code, server.status.description) == (trace.StatusCode.ERROR, "validation_error")
    assert dict(server.attributes) == {"blockgrad.request_id": "r", "blockgrad.status": 422,
                                       "blockgrad.outcome": "validation_error"}
    assert decode.parent.span_id == admit.parent.span_id == server.context.span_id
    assert [(s.start_time, s.end_time) for s in (server, decode, admit)] == [(5, 9), (5, 7), (7, 9)]
    assert dict(admit.attributes) == {"a": 1, "blockgrad.outcome": "validation_error"}


class HeldExporter:
    """Holds its first export until released: the processor's queue then fills."""

    def __init__(self):
        self.entered, self.release, self.exported = threading.Event(), threading.Event(), 0

    def export(self, batch):
        self.entered.set()
        assert self.release.wait(60), "never released"
        self.exported += len(batch)
        return SpanExportResult.SUCCESS

    def shutdown(self, *args, **kwargs):
        pass


def test_a_full_queue_drops_spans_and_counts_them(monkeypatch):
    drops = []
    monkeypatch.setattr(tracing, "DROPPED", lambda amount=1: drops.append(amount))
    exporter = HeldExporter()
    processor = BatchSpanProcessor(exporter, max_queue_size=2, max_export_batch_size=2, schedule_delay_millis=60_000)
    monkeypatch.setattr(tracing, "PROCESSOR", processor)
    span = ReadableSpan("s", trace.SpanContext(1, 2, False, trace.TraceFlags(trace.TraceFlags.SAMPLED)))
    try:
        tracing.hand_over([span] * 2)  # a full batch: the processor's thread takes it and is held exporting
        assert exporter.entered.wait(60), "the batch was never exported"
        tracing.hand_over([span] * 5)  # a request's spans at once: two fill the queue again, three push out older ones
        assert sum(drops) == 3
        tracing.hand_over([span])
        assert sum(drops) == 4
        exporter.release.set()
        assert processor.force_flush(60_000)
        assert exporter.exported == 2 + 5 + 1 - sum(drops)  # what was counted is what never arrived
    finally:
        exporter.release.set()
        processor.shutdown()


class SyncClient:
    """Dask's Client as graph.submit uses it, each task run at once in this process."""

    class Done:
        def __init__(self, key, value):
            self.key, self.value = key, value

    def scatter(self, values, **options):
        return [self.Done("scattered", value) for value in values]

    def submit(self, function, *args, key, pure):
        plain = [arg.value if isinstance(arg, self.Done) else arg for arg in args]
        return self.Done(key, function(*plain))


def test_a_jobs_tile_band_and_finish_tasks_are_spans_of_its_trace(monkeypatch):
    """The graph (app/jobs/graph.py) with more tiles than FINISH_FAN_IN: every task, bands and
    finish too, is a child of the POST's traceparent, on a tracer of this test's."""
    import numpy as np
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from app.core.job_tasks import JobSpec, plan_tiles
    from app.core.objectives import OBJECTIVES
    from app.jobs import graph

    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "TRACER", provider.get_tracer("test"))
    monkeypatch.setattr(graph, "FINISH_FAN_IN", 2)
    trace_id, parent_id = 0x5EED << 64 | 1, 0xCA11E4
    spec = JobSpec(12, 2, 3, "sum", 5.0, "float32", 1 << 20, traceparent=f"00-{trace_id:032x}-{parent_id:016x}-01")
    tiles = plan_tiles(12, 2, 3, 1, tile_numbers=1, least_numbers=1)  # one block each: 9 tiles, 3 rows, 3 columns
    vectors = np.random.default_rng(0).standard_normal((12, 2)).astype(np.float32)
    outcome = graph.submit(SyncClient(), "job-1", vectors, spec, tiles, OBJECTIVES["sum"], 60).final.value
    assert outcome.error is None
    spans = exporter.get_finished_spans()
    assert sorted(span.name for span in spans) == ["band"] * 6 + ["finish"] + ["tile"] * 9
    assert {(span.context.trace_id, span.parent.span_id) for span in spans} == {(trace_id, parent_id)}
