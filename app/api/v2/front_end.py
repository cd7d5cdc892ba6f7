"""/v2's part of the request pipeline (app/http/pipeline.py): the protocol's document (and
binary tensor data) in, output tensors out."""
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace

import torch
from flask import Request, Response

from ...core.admission import AnswerCost
from ...core.dtypes import DTYPES
from ...core.run import Result
from ...http.errors import unsupported_media_type
from ...http.parsing import is_json_mimetype
from ...http.pipeline import Decoded
from ...http.streaming import gather
from .codec import (BINARY_CONTENT_TYPE, CHUNK_BYTES, HEADER_LENGTH, body_length, encode_response, has_binary,
                    iter_body, iter_json)
from .infer import (InferRequest, RequestedOutput, convert_infer_request, decode_infer_request, infer_sizes,
                    output_tensors)

BINARY_INPUT_BYTES_PER_NUMBER = 16  # the decoded array and its native-order copy, float64 at most
JSON_SLICE_BYTES = 2 * CHUNK_BYTES  # a slice of text and orjson's buffer for it


def answer_cost(dtype: str, outputs: tuple[RequestedOutput, ...], body_bytes: int, binary_input: bool) -> AnswerCost:
    """The grid is made a block row at a time, except as JSON beside binary outputs (its header
    is counted first, so it is held whole); JSON outputs are written a slice at a time."""
    item = DTYPES[dtype].item_bytes
    names = {output.name for output in outputs}
    json_names = {output.name for output in outputs if not output.binary}
    grid_held = "block_gradients" in json_names and len(json_names) < len(names)
    cost = AnswerCost(body_bytes=body_bytes, block_row_per_number=item if "block_gradients" in names else 0,
                      grid_per_number=item if grid_held else 0,
                      head_per_number=2 * item if json_names else 0, head_fixed=JSON_SLICE_BYTES if json_names else 0)
    return replace(cost, input_per_number=BINARY_INPUT_BYTES_PER_NUMBER) if binary_input else cost


class V2:
    def accept(self, request: Request) -> None:
        mimetype = request.mimetype
        if mimetype and not is_json_mimetype(mimetype) and mimetype != BINARY_CONTENT_TYPE:
            raise unsupported_media_type(
                f"Send the body as application/json or {BINARY_CONTENT_TYPE} (got {mimetype!r}).")

    def decode(self, body: bytes, request: Request) -> Decoded:
        header_length = request.headers.get(HEADER_LENGTH)
        decoded = decode_infer_request(body, header_length)
        cost = answer_cost(decoded.dtype, decoded.outputs, len(body), binary_input=header_length is not None)
        return Decoded(infer_sizes(decoded), cost, decoded, tuple(output.name for output in decoded.outputs))

    def convert(self, decoded: Decoded) -> InferRequest:
        return convert_infer_request(decoded.document)

    def render(self, job: InferRequest, result: Result | None, device: torch.device,
               timed: Callable[[Iterable], Iterator]) -> Response:
        head, tensors = output_tensors(job, result, device, timed=timed)
        return infer_response(head, tensors)


def infer_response(head: dict, tensors: list) -> Response:
    """JSON only: streamed (the worker holds the output arrays, a block row of block_gradients
    and about one chunk of text). With binary outputs, the JSON header's length is sent first:
    counted, then streamed."""
    if not has_binary(tensors):
        return Response(gather(iter_json(head, tensors), CHUNK_BYTES), mimetype="application/json")
    header_length, payload = encode_response(head, tensors)
    response = Response(iter_body(gather(iter_json(head, tensors), CHUNK_BYTES), payload),
                        content_type=BINARY_CONTENT_TYPE)
    response.headers[HEADER_LENGTH] = str(header_length)
    response.content_length = body_length(header_length, payload)
    return response


FRONT_END = V2()
