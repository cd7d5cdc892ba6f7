"""app/tracing.py in this process, without a server: off unless an OTLP endpoint is set, and
the batch processor counts the spans its full queue drops (an exporter held at a known point)."""
import threading

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExportResult

import app.tracing as tracing


def test_off_without_an_endpoint_sets_no_provider():
    assert tracing.configure({"OTEL_SERVICE_NAME": "x", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}) is False
    assert tracing.TRACER is None and tracing.PROCESSOR is None
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


class HeldExporter:
    """Holds its first export until released: the processor's queue then fills."""

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()

    def export(self, batch):
        self.entered.set()
        assert self.release.wait(60), "never released"
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
