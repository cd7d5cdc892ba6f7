"""POST /v1/gradients: parse (schema), admit (limits), compute, serialise."""
from flask import Response, current_app

from ..compute import Deadline, blocks, load_vectors, summarize
from ..device import resolve_device
from ..limits import admit
from ..parsing import ApiBlueprint
from ..render import head_json, stream_with_blocks, to_numpy
from ..schemas import ErrorSchema, GradientRequest, GradientRequestSchema, GradientResponseSchema

blp = ApiBlueprint("gradients", __name__, url_prefix="/v1",
                   description="Per-block gradients of the pairwise feature matrix.")


@blp.route("/gradients", methods=["POST"])
@blp.arguments(GradientRequestSchema)
@blp.response(200, GradientResponseSchema)
@blp.alt_response(400, schema=ErrorSchema, description="bad_json: the body is not valid JSON.")
@blp.alt_response(413, schema=ErrorSchema, description="too_large or limit_exceeded: over a configured limit.")
@blp.alt_response(415, schema=ErrorSchema, description="unsupported_media_type: not application/json.")
@blp.alt_response(422, schema=ErrorSchema, description="validation_error or non_finite_result.")
@blp.alt_response(503, schema=ErrorSchema, description="deadline_exceeded or device_out_of_memory; see Retry-After.")
def post_gradients(req: GradientRequest):
    """Gradients of every block, each detached as its own leaf, and their sum on the vectors."""
    config = current_app.config
    admit(req.n, req.dim, req.factor, req.outputs, config)
    device = resolve_device(config["BLOCKGRAD_DEVICE"])
    deadline = Deadline(config["BLOCKGRAD_REQUEST_TIMEOUT_S"])
    vectors = load_vectors(req, device)  # (N, D)
    # Blocks whose gradients fit in the memory of one largest block are kept, not recomputed.
    keep_bytes = config["BLOCKGRAD_MAX_BLOCK_ELEMENTS"] * vectors.element_size()
    summary = summarize(vectors, req, deadline, keep_bytes=keep_bytes)
    head = {"n": req.n, "dim": req.dim, "factor": req.factor, "bounds": summary.bounds,
            "objective": req.objective, "dtype": req.dtype, "device": str(device)}
    if "accumulated" in req.outputs:
        head["accumulated"] = to_numpy(summary.accumulated)
    if "losses" in req.outputs:
        head["losses"] = to_numpy(summary.losses)
    if "blocks" not in req.outputs:
        return Response(head_json(head), mimetype="application/json")
    block_source = summary.kept if summary.kept is not None else blocks(vectors, req, deadline)
    return Response(stream_with_blocks(head, iter(block_source)), mimetype="application/json")
