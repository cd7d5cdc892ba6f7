"""POST /v1/gradients: /v1's decoder and renderer around the pipeline (app/http/pipeline.py).

`decode` reads the sizes from the parsed JSON's list lengths and checks the other fields'
JSON types with the schema (schemas.py), converting no number: the pipeline admits the
sizes first, then converts the vectors and raises every field's refusal at once.
`render` writes the answer as JSON bytes (orjson): the head (sizes, bounds, accumulated,
losses) first, then each block serialised as it is taken from the result and flushed in
chunks of about CHUNK_BYTES, so that a worker holds roughly one block of output at a time
whatever N is. A small answer (WHOLE_ANSWER_NUMBERS) whose blocks are all computed is sent
whole instead.
"""
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import orjson
from flask import Request, Response, request
from flask_smorest import Blueprint
from marshmallow import Schema, ValidationError

from ...core.admission import AnswerCost, output_elements
from ...core.dtypes import DEFAULT_DTYPE, DTYPES, WIDEST
from ...core.engine import Block
from ...core.errors import many_unknown, not_an_object, unknown_fields
from ...core.run import Result
from ...http import body  # body.read_body looked up per request (tests replace it)
from ...http.body import decode_document, is_json_mimetype
from ...http.docs import documented, documents_errors
from ...http.errors import wrong_content_type
from ...http.pipeline import Computed, Described, http_call, pipeline
from ...http.sending import NUMPY, gather, json_array, to_numpy
from .schemas import GradientRequestSchema, GradientResponseSchema

blp = Blueprint("gradients", __name__, url_prefix="/v1",
                description="Per-block gradients of the pairwise feature matrix.")

SCHEMA = GradientRequestSchema()  # one instance: not rebuilt (deep-copied fields) per request
CHUNK_BYTES = 256 * 1024
# An answer of at most this many numbers whose blocks were kept from pass one (computed and
# proven finite) goes out whole, with a Content-Length, in one write instead of a chunk per
# piece. Under 1 MiB of JSON even for 1 x 1 blocks (~75 bytes per number with the keys),
# inside the memory prediction's FIXED_BYTES.
WHOLE_ANSWER_NUMBERS = 8192


@blp.route("/gradients", methods=["POST"])
@documented(blp.doc(requestBody={"required": True, "content": {"application/json": {"schema": GradientRequestSchema}}}),
            blp.response(200, GradientResponseSchema))  # the view answers a Response: documentation only
@documents_errors(blp, "bad_json", "unauthorized", "too_large", "limit_exceeded", "unsupported_media_type",
                  "validation_error", "non_finite_result", "deadline_exceeded", "device_out_of_memory",
                  "read_timeout", "overloaded",
                  "internal_error")
def post_gradients():
    """Gradients of every block, each detached as its own leaf, and their sum on the vectors."""
    return render(pipeline(decode(request), http_call()))


def decode(request: Request, schema: Schema = SCHEMA) -> Described:
    """A JSON body (no Content-Type: JSON too) described: sizes, typed fields, raw rows."""
    mimetype = request.mimetype
    if mimetype and not is_json_mimetype(mimetype):
        raise wrong_content_type(mimetype)
    data = body.read_body(request)
    document = decode_document(data)
    # Only a document with more fields than the schema's can have more unknown than a message lists.
    if isinstance(document, dict) and len(document) > len(schema.fields) and \
            (unknown := many_unknown(document, schema.fields)):
        raise unknown_fields(unknown, schema.fields)
    try:
        fields, errors = schema.load(document), {}
    except ValidationError as exc:
        if not isinstance(exc.messages, dict) or set(exc.messages) == {"_schema"}:  # not an object
            messages = exc.messages["_schema"] if isinstance(exc.messages, dict) else exc.messages
            raise not_an_object(messages) from None
        fields, errors = exc.valid_data, exc.messages
    vectors = fields.pop("vectors", None)
    n = dim = None
    if isinstance(vectors, list) and vectors and isinstance(vectors[0], list):
        n, dim = len(vectors), len(vectors[0])
    answer = answer_cost(len(data), fields.get("dtype", DEFAULT_DTYPE))
    return Described(n, dim, vectors, fields, errors, answer)


def answer_cost(body_bytes: int, dtype: str) -> AnswerCost:
    """The document holds the head (accumulated, losses) as text, then one block's text at a
    time: each written once into orjson's buffer and once as the bytes handed on."""
    text = DTYPES.get(dtype, WIDEST).text_bytes
    return AnswerCost(body_bytes=body_bytes, block_per_number=2 * text, head_per_number=2 * text)


def render(computed: Computed) -> Response:
    return Response(render_result(computed.result, computed.timed), mimetype="application/json")


def answer_head(result: Result) -> dict:
    """Every field of the answer but its blocks."""
    req = result.request
    n, dim = req.vectors.shape
    head = {"n": n, "dim": dim, "factor": req.factor, "bounds": result.bounds,
            "objective": req.objective, "dtype": req.dtype, "device": str(result.device)}
    head.update({name: to_numpy(getattr(result, name)) for name in ("accumulated", "losses") if name in req.outputs})
    return head


def render_result(result: Result, timed: Callable[[Iterable], Iterator] = iter) -> bytes | Iterator[bytes]:
    """The whole document; streamed (an iterator) when it holds blocks, unless it is small
    and they are all computed. `timed` wraps the blocks as they are taken (compute time)."""
    req = result.request
    head = answer_head(result)
    if "blocks" not in req.outputs:
        return orjson.dumps(head, option=NUMPY)
    numbers = output_elements(*req.vectors.shape, req.factor, req.outputs)
    if result.kept is not None and numbers <= WHOLE_ANSWER_NUMBERS:
        return whole_json(head, to_numpy(result.losses), timed(result.blocks()))
    return stream_with_blocks(head, timed(result.blocks()))


def whole_json(head: dict, losses: np.ndarray, blocks: Iterator[Block]) -> bytes:
    """The head and every block in one orjson call: the bytes the stream would join to.
    A block's loss is read from `losses` (F, F), the same numbers as its own 0-d tensor."""
    return orjson.dumps(dict(head, blocks=[block_entry(block, losses[block.r, block.c]) for block in blocks]),
                        option=NUMPY)


def block_entry(block: Block, loss) -> dict:
    """One block of the answer; `loss` a numpy scalar (shortest digits of its dtype)."""
    return {"row": block.r, "col": block.c, "rows": block.row_span, "cols": block.col_span,
            "loss": loss, "gradient": json_array(block.gradient)}  # gradient (rows, cols, 2D)


def stream_with_blocks(head: dict, blocks: Iterator[Block]) -> Iterator[bytes]:
    """One JSON object: the head's keys, then "blocks": [...] written as computed.

    The head goes out before any block is computed, so the status line and
    headers are sent first: a failure after that (deadline, device memory) can
    only cut the stream, and the client sees a body without its closing "]}"
    (and, over HTTP/1.1, without the final chunk), never a complete wrong one.
    """
    yield orjson.dumps(head, option=NUMPY)[:-1] + b',"blocks":['
    yield from gather(block_pieces(blocks), CHUNK_BYTES)


def block_pieces(blocks: Iterator[Block]) -> Iterator[bytes]:
    for k, block in enumerate(blocks):
        if k:
            yield b","
        yield orjson.dumps(block_entry(block, to_numpy(block.loss)[()]), option=NUMPY)
    yield b"]}"
