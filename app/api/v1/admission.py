"""/v1's earliest admission: the limits, from the parsed JSON's list lengths.

Runs before the schema converts a number, so a refusal costs the same at any
size. N and D need only `vectors` to be a list of lists; the block and answer
sizes also need `factor` and `outputs` valid as sent (or left out). Anything
else is the schema's to refuse (422); `run` admits again from the request.
"""
from typing import Any

from flask import g

from ...core.limits import admit, admit_shape
from ...core.memory import predict_peak_bytes
from ...core.compute_budget import admit_compute
from ...core.objectives import DEFAULT_OBJECTIVE
from ...core.request import DEFAULT_DTYPE, DEFAULT_OUTPUTS, DTYPES, OUTPUTS, default_factor, ordered_outputs
from ...http.memory import reserve_for_request
from ...http.observe import Work
from ...http.settings import current_objectives, current_settings


def admit_document(document: Any) -> None:
    vectors = document.get("vectors") if isinstance(document, dict) else None
    if not (isinstance(vectors, list) and vectors and isinstance(vectors[0], list)):
        return
    n, dim = len(vectors), len(vectors[0])
    factor = document.get("factor", default_factor(n))
    outputs = document.get("outputs", list(DEFAULT_OUTPUTS))
    if not (type(factor) is int and 1 <= factor <= n and isinstance(outputs, list) and outputs
            and all(isinstance(name, str) and name in OUTPUTS for name in outputs)):
        admit_shape(n, dim, current_settings())
        return
    outputs = ordered_outputs(outputs)
    g.work = Work.of(n, dim, factor, outputs)  # for the log line, even when refused
    settings = current_settings()
    # An objective or dtype the schema will refuse: predicted as the default (the refusal is near).
    dtype = document.get("dtype", DEFAULT_DTYPE)
    dtype = dtype if isinstance(dtype, str) and dtype in DTYPES else DEFAULT_DTYPE
    objective = document.get("objective", DEFAULT_OBJECTIVE)
    objective = objective if isinstance(objective, str) and objective in current_objectives() else DEFAULT_OBJECTIVE
    admit(n, dim, factor, outputs, settings, objective, dtype)
    admit_compute(n, dim, factor, objective, dtype, outputs, settings)
    reserve_for_request(predict_peak_bytes(n, dim, factor, objective, dtype, outputs, encoding="v1_json",
                                           body_bytes=g.get("body_bytes", 0), json_outputs=outputs,
                                           settings=settings))
