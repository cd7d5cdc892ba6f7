"""/v1/jobs' request and response shapes: the body of /v1/gradients, with a job's outputs
and a job's limits instead of the synchronous ones."""
from marshmallow import Schema, ValidationError, fields
from marshmallow.validate import Length

from .schemas import GradientRequestSchema

JOB_OUTPUTS = ("accumulated", "losses")
BLOCKS_REFUSED = ("A job cannot return blocks: its block gradients are N x N x 2D numbers (far more than any "
                  "answer should carry); ask for accumulated and/or losses, or use POST /v1/gradients for blocks.")


def job_output(name: str) -> None:
    if name == "blocks":
        raise ValidationError(BLOCKS_REFUSED)
    if name not in JOB_OUTPUTS:
        raise ValidationError(f"Must be one of: {', '.join(JOB_OUTPUTS)}.")


class JobRequestSchema(GradientRequestSchema):
    outputs = fields.List(fields.String(validate=job_output), load_default=JOB_OUTPUTS, validate=Length(min=1),
                          metadata={"description": "Which results the job keeps: a non-empty subset of "
                                                   "accumulated, losses (default both; repeats are ignored). "
                                                   "blocks is refused (422): N x N x 2D numbers."})

# Its fields are /v1/gradients' (outputs narrowed): it inherits that schema's "unknown" message.


class ProgressSchema(Schema):
    blocks_done = fields.Integer(required=True)
    blocks_total = fields.Integer(required=True, metadata={"description": "F * F."})


class JobSchema(Schema):
    id = fields.String(required=True, metadata={"description": "128 random bits, hexadecimal."})
    status = fields.String(required=True, metadata={"enum": ["queued", "running", "succeeded", "failed", "cancelled"]})
    n = fields.Integer(required=True)
    dim = fields.Integer(required=True)
    factor = fields.Integer(required=True)
    objective = fields.String(required=True)
    dtype = fields.String(required=True)
    outputs = fields.List(fields.String(), required=True)
    progress = fields.Nested(ProgressSchema, required=True)
    attempts = fields.Integer(required=True, metadata={
        "description": "Times the job was started on the cluster: 0 while first queued; more than 1 after its work "
                       "was lost and run again (at most BLOCKGRAD_JOB_ATTEMPTS)."})
    created_at = fields.String(required=True, metadata={"description": "RFC 3339, UTC."})
    started_at = fields.String(allow_none=True, required=True, metadata={"description": "RFC 3339 or null."})
    finished_at = fields.String(allow_none=True, required=True, metadata={"description": "RFC 3339 or null."})
    error = fields.Raw(allow_none=True, required=True, metadata={
        "type": "object", "description": "null, or the usual {code, message, details} of a failed job."})


class JobResultSchema(Schema):
    n = fields.Integer(required=True)
    dim = fields.Integer(required=True)
    factor = fields.Integer(required=True)
    bounds = fields.List(fields.Integer(), required=True)
    objective = fields.String(required=True)
    dtype = fields.String(required=True)
    device = fields.String(required=True, metadata={
        "description": "Where it was computed: cpu (the cluster's workers)."})
    accumulated = fields.Raw(metadata={"type": "array", "items": {"type": "array", "items": {"type": "number"}},
                                       "description": "(N, D), if asked for."})
    losses = fields.Raw(metadata={"type": "array", "items": {"type": "array", "items": {"type": "number"}},
                                  "description": "(F, F), if asked for."})
