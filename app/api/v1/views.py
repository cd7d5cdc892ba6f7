"""POST /v1/gradients: the pipeline with /v1's front end (front_end.py)."""
from ...http.docs import documented, documents_errors
from ...http.parsing import ApiBlueprint
from ...http.pipeline import serve
from .front_end import FRONT_END
from .schemas import GradientRequestSchema, GradientResponseSchema

blp = ApiBlueprint("gradients", __name__, url_prefix="/v1",
                   description="Per-block gradients of the pairwise feature matrix.")


@blp.route("/gradients", methods=["POST"])
@documented(blp.doc(requestBody={"required": True, "content": {"application/json": {"schema": GradientRequestSchema}}}),
            blp.response(200, GradientResponseSchema))  # serve always answers a Response: documentation only
@documents_errors(blp, "bad_json", "unauthorized", "too_large", "limit_exceeded", "unsupported_media_type",
                  "validation_error", "non_finite_result", "deadline_exceeded", "device_out_of_memory",
                  "read_timeout", "overloaded",
                  "internal_error")
def post_gradients():
    """Gradients of every block, each detached as its own leaf, and their sum on the vectors."""
    return serve(FRONT_END)
