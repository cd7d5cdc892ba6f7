"""What the service does, run in this process: the engine, the floor, the parser.

Run with as many torch threads as one gunicorn worker gets, so that in-process
and HTTP times compare like with like.
"""
import os

import flask
import numpy as np
import orjson
import torch

from app.api.v1.schemas import GradientRequestSchema
from app.core.engine import (DEFAULT_CHUNK_ELEMENTS, add_to_vectors, band_blocks, block_bounds, chain_rule_sums,
                             chunk_gradients, plan_bands)
from app.core.objectives import OBJECTIVES
from app.core.request import GradientRequest, build_request
from app.core.run import Deadline, run
from app.core.settings import Settings
from app.core.vectors import to_matrix
from app.extensions import services_of
from app.http.record import release_held
from app.http.sending import to_numpy

NUMPY = orjson.OPT_SERIALIZE_NUMPY
NO_DEADLINE_S = 3600.0
# The in-process engine rows run where BLOCKGRAD_DEVICE says (scripts/gpu_check.sh sets cuda).
DEVICE = os.environ.get("BLOCKGRAD_DEVICE") or "cpu"


def request(matrix: np.ndarray, factor: int, outputs=("blocks", "accumulated"),
            objective: str = "sum", dtype: str = "float32") -> GradientRequest:
    return GradientRequest(vectors=matrix, factor=factor, objective=objective, offset=5.0,
                           outputs=outputs, dtype=dtype)


def engine(req: GradientRequest) -> torch.Tensor:
    """The service's numeric work: pass one (losses, accumulated, finiteness) and pass two
    (every block's gradient, made contiguous as the seed's .grad is). Returns accumulated."""
    result = run(req, Settings(device="cpu"), Deadline(NO_DEADLINE_S))
    for block in result.blocks():
        block.gradient.contiguous()
    return result.accumulated


def answer(req: GradientRequest) -> torch.Tensor:
    """What a request costs the engine for the outputs it asks: pass one, and every block's
    gradient only when blocks are asked. Returns accumulated (on the host)."""
    result = run(req, Settings(device=DEVICE), Deadline(NO_DEADLINE_S))
    if "blocks" in req.outputs:
        for block in result.blocks():
            block.gradient.contiguous()
    return result.accumulated.cpu()


def floor_body(req: GradientRequest) -> bytes:
    """The least work that yields the same answer: one pass over the blocks, every array
    kept, one orjson.dumps. Same keys in the same order as the service writes them."""
    vectors = torch.as_tensor(req.vectors, dtype=torch.float32 if req.dtype == "float32" else torch.float64,
                              device=DEVICE)  # (N, D), on the device the service uses
    accumulated = torch.zeros_like(vectors)  # (N, D)
    kept = []
    for band in plan_bands(req.n, req.dim, req.factor, DEFAULT_CHUNK_ELEMENTS):
        band = [chunk_gradients(vectors, chunk, OBJECTIVES[req.objective], req.offset) for chunk in band]
        for result in band:
            add_to_vectors(accumulated, accumulated, result.chunk, chain_rule_sums(result))
        kept.extend({"row": block.r, "col": block.c, "rows": block.row_span, "cols": block.col_span,
                     "loss": to_numpy(block.loss)[()], "gradient": to_numpy(block.gradient)}
                    for block in band_blocks(band))
    return orjson.dumps({
        "n": req.n, "dim": req.dim, "factor": req.factor, "bounds": block_bounds(req.n, req.factor),
        "objective": req.objective, "dtype": req.dtype, "device": str(vectors.device),
        "accumulated": to_numpy(accumulated), "blocks": kept,
    }, option=NUMPY)


SCHEMA = GradientRequestSchema()  # one instance, as the view holds
_app = None


def parse_and_validate(body: bytes) -> GradientRequest:
    """What /v1's decoder and the pipeline convert: orjson.loads, the marshmallow schema (the
    fields' types; it reads the app's objectives, so it runs in a request context), then the
    vectors and the core's request."""
    global _app
    if _app is None:
        from app import create_app

        _app = create_app()
    with _app.test_request_context():
        try:
            fields = SCHEMA.load(orjson.loads(body))
            return build_request(to_matrix(fields.pop("vectors")), objectives=services_of(_app).objectives, **fields)
        finally:
            release_held(flask.g)
