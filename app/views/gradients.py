"""POST /v1/gradients: parse, admit (limits), validate (schema), compute, serialise."""
from typing import Any

from flask import Response, current_app, g

from ..compute import blocks, checked, start, summarize
from ..docs import documents_errors
from ..engine import default_factor
from ..limits import admit, admit_shape, output_elements
from ..observe import Work
from ..parsing import ApiBlueprint, OrjsonParser
from ..render import head_json, stream_with_blocks, to_numpy
from ..schemas import DEFAULT_OUTPUTS, OUTPUTS, GradientRequest, GradientRequestSchema, GradientResponseSchema


def admit_document(document: Any) -> None:
    """The limits, from the parsed JSON's list lengths, before the schema converts a number:
    a refusal costs the same at any size. N and D need only `vectors` to be a list of lists;
    the block and answer sizes also need `factor` and `outputs` valid as sent (or left out).
    Anything else is the schema's to refuse (422); the view admits again from the result."""
    vectors = document.get("vectors") if isinstance(document, dict) else None
    if not (isinstance(vectors, list) and vectors and isinstance(vectors[0], list)):
        return
    n, dim = len(vectors), len(vectors[0])
    factor = document.get("factor", default_factor(n))
    outputs = document.get("outputs", list(DEFAULT_OUTPUTS))
    if not (type(factor) is int and 1 <= factor <= n and isinstance(outputs, list) and outputs
            and all(isinstance(name, str) and name in OUTPUTS for name in outputs)):
        admit_shape(n, dim, current_app.config)
        return
    outputs = tuple(name for name in OUTPUTS if name in outputs)
    g.work = Work(n, dim, factor, outputs, output_elements(n, dim, factor, outputs))  # for the log line
    admit(n, dim, factor, outputs, current_app.config)


class GradientsBlueprint(ApiBlueprint):
    ARGUMENTS_PARSER = OrjsonParser(admit_document)


blp = GradientsBlueprint("gradients", __name__, url_prefix="/v1",
                         description="Per-block gradients of the pairwise feature matrix.")


@blp.route("/gradients", methods=["POST"])
@blp.arguments(GradientRequestSchema)
@blp.response(200, GradientResponseSchema)
@documents_errors(blp, "bad_json", "unauthorized", "too_large", "limit_exceeded", "unsupported_media_type",
                  "validation_error", "non_finite_result", "deadline_exceeded", "device_out_of_memory",
                  "internal_error")
def post_gradients(req: GradientRequest):
    """Gradients of every block, each detached as its own leaf, and their sum on the vectors."""
    config = current_app.config
    g.work = work = Work(req.n, req.dim, req.factor, req.outputs,
                         output_elements(req.n, req.dim, req.factor, req.outputs))  # for the log line and metrics
    device, deadline, vectors = start(req, config)  # vectors: (N, D)
    g.device = str(device)
    # Blocks whose gradients fit in the memory of one largest block are kept, not recomputed.
    keep_bytes = config["BLOCKGRAD_MAX_BLOCK_ELEMENTS"] * vectors.element_size()
    with work.computing():
        summary = summarize(vectors, req, deadline, keep_bytes=keep_bytes)
    head = {"n": req.n, "dim": req.dim, "factor": req.factor, "bounds": summary.bounds,
            "objective": req.objective, "dtype": req.dtype, "device": str(device)}
    if "accumulated" in req.outputs:
        head["accumulated"] = to_numpy(summary.accumulated)
    if "losses" in req.outputs:
        head["losses"] = to_numpy(summary.losses)
    if "blocks" not in req.outputs:
        return Response(head_json(head), mimetype="application/json")
    # Kept blocks are streamed as they are; else pass two recomputes them. The deadline holds for both.
    block_source = checked(summary.kept, deadline) if summary.kept is not None else blocks(vectors, req, deadline)
    return Response(stream_with_blocks(head, work.timed(block_source)), mimetype="application/json")
