"""app/tracing.py in this process, without a server: off unless an OTLP endpoint is set, and
the batch processor counts the spans its full queue drops (an exporter held at a known point)."""
import threading

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExportResult

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


def test_a_full_queue_drops_spans_and_counts_them():
    exporter = HeldExporter()
    processor = tracing.batch_processor(exporter, max_queue_size=2, max_export_batch_size=2,
                                        schedule_delay_millis=60_000)
    provider = TracerProvider()
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("test")
    try:
        for _ in range(2):  # a full batch: the processor's thread takes it and is held exporting
            tracer.start_span("s").end()
        assert exporter.entered.wait(60), "the batch was never exported"
        for _ in range(5):  # two fill the queue again, three push out older ones
            tracer.start_span("s").end()
        assert processor.dropped == 3
    finally:
        exporter.release.set()
        provider.shutdown()
