"""Probes: /healthz (the process answers) and /readyz (torch and the device work)."""
import torch
from flask import current_app, g

from ..device import resolve_device
from ..docs import OPEN_ROUTE, documents_errors
from ..errors import ApiError
from ..parsing import ApiBlueprint
from ..schemas import HealthSchema, ReadySchema

blp = ApiBlueprint("health", __name__, description="Liveness and readiness probes.")


@blp.route("/healthz", methods=["GET"])
@blp.doc(**OPEN_ROUTE)
@blp.response(200, HealthSchema)
@documents_errors(blp, "internal_error")
def healthz():
    """The process is alive."""
    return {"status": "ok"}


@blp.route("/readyz", methods=["GET"])
@blp.doc(**OPEN_ROUTE)
@blp.response(200, ReadySchema)
@documents_errors(blp, "not_ready", "internal_error")
def readyz():
    """torch is loaded and the configured device runs a small computation."""
    return {"status": "ready", "device": str(usable_device())}


def usable_device() -> torch.device:
    """The configured device, once it has run a small computation; 503 not_ready if it cannot."""
    try:
        device = resolve_device(current_app.config["BLOCKGRAD_DEVICE"])
        probe = torch.ones(2, device=device).sum().item()
    except (ValueError, RuntimeError) as exc:
        raise ApiError(503, "not_ready", f"The compute device is not usable: {exc}") from None
    g.device = str(device)  # for the device metric (app/observe.py)
    if probe != 2.0:
        raise ApiError(503, "not_ready", "The compute device gave a wrong answer to a probe.")
    return device
