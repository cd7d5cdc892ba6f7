"""Probes: /healthz (the process answers) and /readyz (torch and the device work); `device_ready`,
what /v2's and gRPC's readiness answer."""
import logging

from flask_smorest import Blueprint
from marshmallow import Schema, fields

from ..core.device import ready_device
from ..core.errors import BlockgradError
from ..http.docs import OPEN_ROUTE, documents_errors
from ..extensions import services
from flask import g

log = logging.getLogger("blockgrad")
blp = Blueprint("health", __name__, description="Liveness and readiness probes.")


class HealthSchema(Schema):
    status = fields.String(required=True, metadata={"example": "ok", "description": "Always `ok`."})


class ReadySchema(Schema):
    status = fields.String(required=True, metadata={"example": "ready", "description": "Always `ready`."})
    device = fields.String(required=True, metadata={
        "example": "cpu", "description": "The device this worker computes on (BLOCKGRAD_DEVICE resolved)."})
    cluster = fields.Dict(metadata={
        "example": {"store": "sqlite", "reachable": True, "workers": 2},
        "description": "The jobs' side, never where it is and never waited for (readiness is about synchronous "
                     "serving): `store`, the job store's kind (sqlite or postgresql; null: no jobs), and, as the "
                     "last read of the store found them (at most seconds old), `workers`, the Dask workers the job "
                     "runners see, and `reachable`, whether they reach a cluster with a worker. Informational: it "
                     "never makes /readyz fail."})

@blp.route("/healthz", methods=["GET"])
@blp.doc(**OPEN_ROUTE)
@blp.response(200, HealthSchema)
@documents_errors(blp, "internal_error")
def healthz():
    """The process is alive."""
    return {"status": "ok"}


# Readiness says nothing about load: a worker that refuses work (503 overloaded) is shedding
# it, and taking the pod out of the Service for that moves the load onto the other replicas
# until none is ready (docs/errors-edge.md, "Readiness").
@blp.route("/readyz", methods=["GET"])
@blp.doc(**OPEN_ROUTE)
@blp.response(200, ReadySchema)
@documents_errors(blp, "not_ready", "internal_error")
def readyz():
    """torch is loaded and the configured device runs a small computation."""
    device = ready_device(services().settings.device)  # not_ready if it cannot
    g.device = str(device)  # for the device metric (app/http/record.py)
    return {"status": "ready", "device": str(device), "cluster": services().jobs.cluster_report()}


def device_ready(settings=None, state=None) -> bool:
    """Whether the device runs; `state` (default Flask's `g`) records it for the device metric."""
    try:
        (g if state is None else state).device = str(ready_device((settings or services().settings).device))
    except BlockgradError as exc:
        log.warning("not ready: %s", exc.message)
        return False
    return True
