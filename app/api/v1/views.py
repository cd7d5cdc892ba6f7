"""POST /v1/gradients: the schema builds the core's request, the core runs it, render.py writes it."""
from flask import Response, g

from ...core.limits import admit_request
from ...core.run import run
from ...http.docs import documents_errors
from ...http.observe import Work
from ...http.parsing import ApiBlueprint
from ...http.settings import current_settings
from ...http.slot import compute_slot, held_until_written, request_deadline
from ...core.request import GradientRequest
from .render import render_result
from .schemas import GradientRequestSchema, GradientResponseSchema

blp = ApiBlueprint("gradients", __name__, url_prefix="/v1",
                   description="Per-block gradients of the pairwise feature matrix.")


@blp.route("/gradients", methods=["POST"])
@blp.arguments(GradientRequestSchema())  # one instance: not rebuilt (deep-copied fields) per request
@blp.response(200, GradientResponseSchema)
@documents_errors(blp, "bad_json", "unauthorized", "too_large", "limit_exceeded", "unsupported_media_type",
                  "validation_error", "non_finite_result", "deadline_exceeded", "device_out_of_memory",
                  "read_timeout", "overloaded",
                  "internal_error")
def post_gradients(req: GradientRequest):
    """Gradients of every block, each detached as its own leaf, and their sum on the vectors."""
    g.work = work = Work.of(req.n, req.dim, req.factor, req.outputs)  # for the log line and metrics
    admit_request(req, current_settings())  # the schema admitted the sizes; this adds a model's activations
    deadline = request_deadline()
    ticket = compute_slot(req, deadline)  # one computation at a time; held while blocks stream
    try:
        with work.computing():
            result = run(req, current_settings(), deadline)
        g.device = str(result.device)
        body = render_result(result, work)
    except BaseException:
        ticket.release()
        raise
    streams_computed_blocks = "blocks" in req.outputs and result.kept is None  # recomputed as written
    return Response(held_until_written(body, ticket, computes=streams_computed_blocks), mimetype="application/json")
