"""Prometheus metrics (prometheus-client), one set per process.

Under gunicorn, PROMETHEUS_MULTIPROC_DIR is set by gunicorn.conf.py before the
workers import this module, so every value lives in a memory-mapped file in that
directory and a scrape answered by any worker adds up all of them
(MultiProcessCollector). Without the variable (tests, `flask run`) the default
in-process registry is used.

Label values are bounded: `route` is the URL rule (`/v1/gradients`, never the
raw path; `unmatched` for 404/405; a gRPC call's full method name), `method` is folded to a
fixed set (GRPC for gRPC calls, whose `status` is the gRPC status's name), `code` comes from
the fixed set of error codes.
"""
import os

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "GRPC"})  # GRPC: route is its method
# Requests may run up to BLOCKGRAD_REQUEST_TIMEOUT_S (60 s by default).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, float("inf"))

REQUESTS = Counter("blockgrad_requests", "Requests answered, by route (URL rule or gRPC method), method and status.",
                   ["route", "method", "status"])
LATENCY = Histogram("blockgrad_request_duration_seconds",
                    "Time from the request's arrival to its last body byte, by route.",
                    ["route"], buckets=LATENCY_BUCKETS)
IN_FLIGHT = Gauge("blockgrad_requests_in_flight", "Requests being answered now (summed over live workers).",
                  multiprocess_mode="livesum")
OUTPUT_NUMBERS = Counter("blockgrad_output_numbers", "Numbers written in complete 200 answers.")
COMPUTE_SECONDS = Counter("blockgrad_compute_seconds", "Seconds spent in the gradient engine, failed requests too.")
ERRORS = Counter("blockgrad_errors", "Error answers by error code (including errors that cut a stream).",
                 ["code"])
TRACE_SPANS_DROPPED = Counter("blockgrad_trace_spans_dropped", "Spans dropped unexported: the trace exporter's "
                              "queue (OTEL_BSP_MAX_QUEUE_SIZE) was full.")
DEVICE = Gauge("blockgrad_device_info", "1 for the torch device each live worker computes on (label device).",
               ["device"], multiprocess_mode="liveall")


def exposition() -> tuple[bytes, str]:
    """The text format (0.0.4, what generate_latest writes) body for a scrape and its content type."""
    if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
        registry = CollectorRegistry()  # fresh each scrape: it reads every worker's files
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_PLAIN_0_0_4
    return generate_latest(REGISTRY), CONTENT_TYPE_PLAIN_0_0_4

# The compute gate (app/core/slots.py): one computation per worker, a bounded queue in front.
QUEUE_DEPTH = Gauge("blockgrad_queue_depth", "Requests waiting for a compute slot (summed over live workers).",
                    multiprocess_mode="livesum")
QUEUE_WAIT = Histogram("blockgrad_queue_wait_seconds", "Time a computing request waited for its compute slot.",
                       buckets=LATENCY_BUCKETS)
SHED = Counter("blockgrad_shed_requests", "Requests refused at once (503 overloaded): the queue was full.")
SLOTS = Gauge("blockgrad_compute_slots", "Compute slots of the pod: one per core, shared by its workers.", multiprocess_mode="livemax")
SLOTS_BUSY = Gauge("blockgrad_compute_slots_busy", "Compute slots of the pod held now (read when scraped).", multiprocess_mode="livemostrecent")
