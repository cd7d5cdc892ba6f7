"""Compute admission: refuse up front, in milliseconds, what cannot finish within the deadline.

The engine's cost model (app/core/cost.py) predicts a request's seconds from its sizes,
objective and dtype; a prediction over BLOCKGRAD_REQUEST_TIMEOUT_S is `limit_exceeded`
(413) with the prediction and the deadline in its details, and the factor the model
predicts fastest when that one would finish in time, instead of a worker burning the
whole deadline to answer 503 deadline_exceeded. A request predicted within the deadline
still has the deadline checked between blocks (app/core/run.py): the model is an
estimate (within about 2x on the machine it was measured on).
"""
from .cost import predict_seconds
from .errors import limit_exceeded
from .limits import suggested_factor
from .settings import Settings


def admit_compute(n: int, dim: int, factor: int, objective: str, dtype: str, outputs: tuple[str, ...],
                  settings: Settings) -> None:
    """limit_exceeded if the predicted seconds are over the deadline; `outputs`: the core's names."""
    if not outputs:  # nothing to compute (e.g. /v2 asking only for bounds)
        return
    deadline = settings.request_timeout_s
    predicted = predict_seconds(n, dim, factor, objective, dtype, outputs, settings)
    if predicted <= deadline:
        return
    extra: dict = {"predicted_s": round(predicted, 3), "deadline_s": deadline}
    advice = "send fewer vectors or ask for fewer outputs"
    better = suggested_factor(n, dim, outputs, settings, objective, dtype)
    if better is not None and better != factor:
        better_s = predict_seconds(n, dim, better, objective, dtype, outputs, settings)
        if better_s <= deadline:
            extra["suggested_factor"] = better
            advice = f"factor {better} is predicted to take about {better_s:.2g} s"
    raise limit_exceeded(
        f"This request is predicted to take about {predicted:.3g} s, over the deadline "
        f"BLOCKGRAD_REQUEST_TIMEOUT_S = {deadline:g} s; {advice}.",
        "BLOCKGRAD_REQUEST_TIMEOUT_S", round(predicted, 3), deadline, **extra)
