"""Ready fast: the app imported before fork where that is safe, and one small computation in
each worker before it accepts connections."""
import os


def warm_start(device: str) -> bool:
    """Whether the master may import torch and the app before forking, so that a restarted
    worker is ready in milliseconds instead of seconds. CPU only: a CUDA context must never
    cross fork, so with a GPU (or one that may be there) each worker imports after fork."""
    return device == "cpu" or (device == "auto" and not os.path.exists("/dev/nvidiactl"))


def warm_up(settings) -> Exception | None:
    """Run one small request (both passes) so that the worker's first real one does not pay
    torch's lazy start-up (the CUDA context on a GPU). Returns what failed instead of
    raising: a worker whose device fails still starts, and /readyz says why."""
    import numpy as np  # the worker's imports, not the master's

    from app.core.request import GradientRequest
    from app.core.run import run

    req = GradientRequest(vectors=np.arange(8.0).reshape(4, 2), factor=2, objective="sum", offset=0.0,
                          outputs=("blocks", "accumulated", "losses"), dtype="float32")
    try:
        list(run(req, settings).blocks())
    except Exception as exc:  # noqa: BLE001 - reported, never fatal
        return exc
    return None  # the worker's device works
