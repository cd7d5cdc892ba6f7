"""GET /metrics: Prometheus text format, all gunicorn workers added up (app/http/metrics.py)."""
from flask import Response
from flask_smorest import Blueprint

from ..http.docs import OPEN_ROUTE, documents_errors
from ..extensions import services
from ..http.metrics import SLOTS, SLOTS_BUSY, exposition

blp = Blueprint("metrics", __name__, description="Prometheus metrics.")


@blp.route("/metrics", methods=["GET"])
@blp.doc(**OPEN_ROUTE)
@blp.response(200, {"type": "string"}, content_type="text/plain",
              description="Prometheus text exposition format, version 0.0.4 (metric names in docs/operations.md).")
@documents_errors(blp, "internal_error")
def get_metrics():
    """Request counts, latencies, in-flight requests, outputs, compute time, errors and device."""
    found = services()
    source = found.gate.source  # the pod's slots are read now, from whichever worker answers
    SLOTS.set(source.count)
    SLOTS_BUSY.set(source.busy)
    if found.jobs is not None:  # the job gauges, read from the scheduler now (bounded in time)
        found.jobs.refresh_metrics()
    with found.scrape_lock():  # only the files' read: the master's folds wait for nothing else
        body, content_type = exposition()
    return Response(body, content_type=content_type)
