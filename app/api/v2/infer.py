"""One inference request: protocol document -> the core's GradientRequest -> output tensors.

`decode` reads the envelope (inputs, outputs, parameters) and the input's
declared shape without converting a number, and describes the request to the pipeline
(app/http/pipeline.py), which admits those sizes and then converts the data (JSON, or binary
tensor data) through the core, so the rules, defaults and limits are the core's, as for /v1.
`output_tensors` turns the core's result into the protocol's output tensors.
"""
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import numpy as np
import torch
from flask import Request, Response
from marshmallow import ValidationError

from ...core.dtypes import DTYPES
from ...core.engine import block_bounds
from ...core.errors import BlockgradError, invalid_request as invalid, listed_names, many_unknown
from ...core.admission import AnswerCost
from ...core.request import GradientRequest, ordered_outputs
from ...core.run import Result
from ...core.vectors import Buffer
from ...http import body  # body.read_body looked up per request (tests replace it)
from ...http.body import decode_json, is_json_mimetype
from ...http.errors import unsupported_media_type
from ...http.pipeline import Computed, Described
from ...http.sending import gather, to_numpy
from .codec import (BINARY_CONTENT_TYPE, CHUNK_BYTES, HEADER_LENGTH, CodecError, OutputTensor, RowSlabs, iter_body,
                    iter_json, split_body)
from .model import DATATYPE_OF_DTYPE, FLOAT_DATATYPES, GRADIENT_PARAMETERS, INPUT_NAME, MODEL_NAME, MODEL_VERSION, OUTPUTS
from .schemas import InferRequestSchema, ParametersSchema, RequestInputSchema, RequestOutputSchema

BINARY_INPUT_BYTES_PER_NUMBER = 16  # the decoded array and its native-order copy, float64 at most
JSON_SLICE_BYTES = 2 * CHUNK_BYTES  # a slice of text and orjson's buffer for it
# One instance each, as /v1's view holds (marshmallow deep-copies the fields per instance).
INFER_REQUEST_SCHEMA, PARAMETERS_SCHEMA = InferRequestSchema(), ParametersSchema()
ENVELOPE_FIELDS = tuple(INFER_REQUEST_SCHEMA.fields)
INPUT_FIELDS, OUTPUT_FIELDS = tuple(RequestInputSchema().fields), tuple(RequestOutputSchema().fields)


@dataclass(frozen=True)
class RequestedOutput:
    name: str
    binary: bool


def decode(request: Request) -> Described:
    """/v2's decoder: a JSON document, or one with binary tensor data after it, read up to the
    numbers: nothing is converted here."""
    mimetype = request.mimetype
    if mimetype and not is_json_mimetype(mimetype) and mimetype != BINARY_CONTENT_TYPE:
        raise unsupported_media_type(f"Send the body as application/json or {BINARY_CONTENT_TYPE} (got {mimetype!r}).")
    sent, header_length = body.read_body(request), request.headers.get(HEADER_LENGTH)
    try:
        header, binary = split_body(sent, header_length)
    except CodecError as exc:
        raise invalid(str(exc)) from None
    return describe(decode_json(header), binary, len(sent), binary_input=header_length is not None)  # bad_json: 400


def describe(document: object, binary: memoryview, body_bytes: int, binary_input: bool) -> Described:
    """A request document (and the binary tensor data after it) checked and described; the
    gRPC front end describes its messages as this document too."""
    check_envelope_sizes(document)
    try:
        envelope = INFER_REQUEST_SCHEMA.load(document)
    except ValidationError as exc:
        raise invalid(f"The inference request is not valid: {flatten(exc.messages)}") from None
    datatype, n, d, data = declared_input(envelope["inputs"], binary)
    parameters = dict(envelope["parameters"])
    binary_output = parameters.pop("binary_data_output", False)
    if not isinstance(binary_output, bool):
        raise invalid("Parameter 'binary_data_output' must be true or false.")
    unknown = sorted(set(parameters) - set(GRADIENT_PARAMETERS))
    if unknown:
        raise invalid(f"Unknown parameters {unknown}; this model takes {list(GRADIENT_PARAMETERS)} "
                      "and binary_data_output.")
    outputs = requested_outputs(envelope.get("outputs"), binary_output)
    try:
        typed, errors = PARAMETERS_SCHEMA.load(parameters), {}  # JSON types, as /v1 checks its fields
    except ValidationError as exc:
        typed, errors = exc.valid_data, exc.messages
    numbers, dtype = FLOAT_DATATYPES[datatype]
    fields = {**typed, "dtype": dtype, "outputs": ordered_outputs({OUTPUTS[o.name] for o in outputs} - {None})}
    vectors = data if data is not None else Buffer(binary, numbers)
    cost = answer_cost(dtype, outputs, body_bytes, binary_input)
    return Described(n, d, vectors, fields, errors, cost, declared=True,
                     logged_outputs=tuple(output.name for output in outputs), own=(outputs, envelope.get("id")))


def render(computed: Computed) -> Response:
    """JSON only: streamed (the worker holds the output arrays, a block row of block_gradients
    and about one chunk of text). With binary outputs, the JSON header's length is sent first:
    counted, then streamed."""
    head, tensors = output_tensors(computed.request, *computed.own, computed.result, computed.device, computed.timed)
    payload = [tensor.array for tensor in tensors if tensor.binary]  # the bytes after the header, in order
    if not payload:
        return Response(gather(iter_json(head, tensors), CHUNK_BYTES), mimetype="application/json")
    # The header's length goes first, so it is counted first: serialised twice, a piece at a
    # time, never held whole (slabs in it are made twice).
    header_length = sum(len(piece) for piece in iter_json(head, tensors))
    response = Response(iter_body(gather(iter_json(head, tensors), CHUNK_BYTES), payload),
                        content_type=BINARY_CONTENT_TYPE)
    response.headers[HEADER_LENGTH] = str(header_length)
    response.content_length = header_length + sum(array.nbytes for array in payload)
    return response


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


def refuse_many_unknown(mapping: object, known, where: str) -> None:
    """More unknown keys than a message lists: refused in O(keys) (core.errors.many_unknown)."""
    if isinstance(mapping, dict) and len(mapping) > len(known) and (unknown := many_unknown(mapping, known)):
        raise invalid(f"Unknown {where}: {listed_names(unknown, len(unknown))}; known: {', '.join(known)}.")


def check_envelope_sizes(document: object) -> None:
    """The protocol's maps and lists here are short: refuse long ones before the schema walks them."""
    if not isinstance(document, dict):
        return  # the schema's to refuse
    refuse_many_unknown(document, ENVELOPE_FIELDS, "fields")
    refuse_many_unknown(document.get("parameters"), (*GRADIENT_PARAMETERS, "binary_data_output"), "parameters")
    inputs, outputs = (value if isinstance(value, list) else [] for value in (document.get("inputs"),
                                                                               document.get("outputs")))
    if len(inputs) > 1:
        raise invalid(f"The model takes exactly one input, '{INPUT_NAME}'; got {len(inputs)} inputs.")
    if len(outputs) > len(OUTPUTS):
        raise invalid(f"The model has {len(OUTPUTS)} outputs {list(OUTPUTS)}; {len(outputs)} were asked for.")
    for entry, fields, known in [*((tensor, INPUT_FIELDS, ("binary_data_size",)) for tensor in inputs),
                                 *((tensor, OUTPUT_FIELDS, ("binary_data",)) for tensor in outputs)]:
        if isinstance(entry, dict):
            refuse_many_unknown(entry, fields, "fields of a tensor")
            refuse_many_unknown(entry.get("parameters"), known, "parameters of a tensor")


@contextmanager
def named_as_protocol() -> Iterator[None]:
    """Fields refused (one 422 from the pipeline) named as the protocol names them: /v2's and gRPC's."""
    try:
        yield
    except BlockgradError as exc:
        if exc.code == "validation_error" and isinstance(exc.details.get("fields"), dict):
            raise invalid(" ".join(f"{field_label(name)}: {flatten(messages)}"
                                    for name, messages in sorted(exc.details["fields"].items()))) from None
        raise


def declared_input(inputs: list[dict], binary: memoryview) -> tuple[str, int, int, object | None]:
    """The `vectors` input's datatype, N, D and data (the JSON `data`, or None when binary: the
    bytes after the header), checked without reading a number."""
    names = [tensor["name"] for tensor in inputs]
    if names != [INPUT_NAME]:
        raise invalid(f"The model takes exactly one input, '{INPUT_NAME}'; got {names}.")
    tensor = inputs[0]
    datatype, shape, parameters = tensor["datatype"], tensor["shape"], dict(tensor["parameters"])
    if datatype not in FLOAT_DATATYPES:
        raise invalid(f"Input '{INPUT_NAME}' must have datatype FP32 or FP64, got {datatype!r}.")
    if len(shape) != 2:
        raise invalid(f"Input '{INPUT_NAME}' must have shape [N, D], got {shape}.")
    n, d = shape
    # A small body may declare a huge shape: nothing is built from it before it is admitted.
    if n < 1:
        raise invalid(f"Input '{INPUT_NAME}' must be non-empty: shape {shape} declares no vectors "
                      "(N must be at least 1).")
    if d < 1:
        raise invalid(f"Input '{INPUT_NAME}' must have non-empty rows: shape {shape} declares vectors of length 0 "
                      "(D must be at least 1).")
    size = parameters.pop("binary_data_size", None)
    if parameters:
        raise invalid(f"Unknown parameters {sorted(parameters)} on input '{INPUT_NAME}'.")
    if size is None:
        if "data" not in tensor:
            raise invalid(f"Input '{INPUT_NAME}' has neither data nor binary_data_size.")
        if len(binary):
            raise invalid(f"{len(binary)} bytes follow the JSON header but no input has binary_data_size.")
        return datatype, n, d, tensor["data"]
    if "data" in tensor:
        raise invalid(f"Input '{INPUT_NAME}' has both data and binary_data_size; send one.")
    if type(size) is not int or size < 0:
        raise invalid(f"binary_data_size of input '{INPUT_NAME}' must be a whole number of bytes.")
    if size != len(binary):
        raise invalid(f"binary_data_size of input '{INPUT_NAME}' is {size} but {len(binary)} bytes "
                      "follow the JSON header.")
    return datatype, n, d, None


def requested_outputs(outputs: list[dict] | None, binary_default: bool) -> tuple[RequestedOutput, ...]:
    if outputs is None:
        return tuple(RequestedOutput(name, binary_default) for name in OUTPUTS)
    chosen = []
    for output in outputs:
        name, parameters = output["name"], dict(output["parameters"])
        if name not in OUTPUTS:
            raise invalid(f"Unknown output {name!r}; the model has {list(OUTPUTS)}.")
        if name in (c.name for c in chosen):
            raise invalid(f"Output {name!r} is asked for twice.")
        binary = parameters.pop("binary_data", binary_default)
        if not isinstance(binary, bool):
            raise invalid(f"Parameter 'binary_data' of output {name!r} must be true or false.")
        if parameters:
            raise invalid(f"Unknown parameters {sorted(parameters)} on output {name!r}.")
        chosen.append(RequestedOutput(name, binary))
    return tuple(chosen)


def output_tensors(req: GradientRequest, outputs: tuple[RequestedOutput, ...], request_id: str | None,
                   result: Result | None, device, timed: Callable[[Iterator], Iterator]) -> tuple[dict, list[OutputTensor]]:
    """The response head and its output tensors (`outputs` in the order they are answered;
    `req.outputs` only what they need computed), from the core's result (None when only
    `bounds` was asked for: nothing was computed; `device` is then the one named).

    block_gradients is made as it is written, a block row at a time (`timed` wraps the blocks,
    e.g. to count compute time), except as JSON beside binary outputs: that header is
    serialised twice (its length goes first), so the grid is made once and held."""
    datatype = DATATYPE_OF_DTYPE[req.dtype]
    any_binary = any(output.binary for output in outputs)

    def output_array(output: RequestedOutput) -> np.ndarray | RowSlabs:
        if output.name == "block_gradients":
            grid = RowSlabs((req.n, req.n, 2 * req.dim), np.dtype(req.dtype),
                            lambda: gradient_rows(result, timed))  # (N, N, 2D)
            return grid if output.binary or not any_binary else grid.whole()
        if output.name == "bounds":
            return np.array(block_bounds(req.n, req.factor), dtype=np.int64)
        return to_numpy(result.accumulated if output.name == "accumulated" else result.losses)

    tensors = [OutputTensor(output.name, "INT64" if output.name == "bounds" else datatype,
                            output_array(output), output.binary) for output in outputs]
    parameters = {"factor": req.factor, "objective": req.objective, "offset": req.offset,
                  "device": str(result.device if result is not None else device)}
    return {"model_name": MODEL_NAME, "model_version": MODEL_VERSION,
            **({} if request_id is None else {"id": request_id}), "parameters": parameters}, tensors


def gradient_rows(result: Result, timed: Callable[[Iterator], Iterator] = iter) -> Iterator[np.ndarray]:
    """The (N, N, 2D) pair-matrix gradient as (rows, N, 2D) slabs, one block row each, top to
    bottom, every block copied into place as it comes (ragged last blocks need no padding), so
    that no more than the blocks' band is held. Blocks that are one number broadcast are held
    until one is not (they hold a number each): a row of them all equal is that number broadcast
    over the slab (every stride 0: autograd's gradient of sum, and of mean over blocks of one
    size), which codec.iter_body writes without making it."""
    n, dim = result.request.n, result.request.dim
    top, numbers, slab = None, [], None
    for block in timed(result.blocks()):  # row-block-major: a block row's blocks come together
        if block.row_span[0] != top:
            if top is not None:
                yield slab.numpy() if slab is not None else broadcast_row(numbers, n, dim)
            top, numbers, slab = block.row_span[0], [], None
        if slab is None and not any(block.gradient.stride()):
            numbers.append(block)
            continue
        if slab is None:
            slab = empty_slab(block, n, dim)
        copy_into(slab, [*numbers, block])  # the numbers held so far, then this block
        numbers = []
    if top is not None:
        yield slab.numpy() if slab is not None else broadcast_row(numbers, n, dim)


BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # compared as bits: -0.0 is not 0.0


def broadcast_row(blocks: list, n: int, dim: int) -> np.ndarray:
    """A block row whose blocks are each one number broadcast: that number over the slab when
    they are all the same, else each copied into place."""
    firsts = torch.stack([block.gradient.reshape(-1)[0] for block in blocks]).cpu()  # (F,)
    bits = firsts.view(BITS[firsts.element_size()])
    if bool((bits == bits[0]).all()):
        return np.broadcast_to(firsts[:1].numpy(), (blocks[0].row_span[1] - blocks[0].row_span[0], n, 2 * dim))
    slab = empty_slab(blocks[0], n, dim)
    copy_into(slab, blocks)
    return slab.numpy()


def empty_slab(block, n: int, dim: int) -> torch.Tensor:
    """The host slab (rows, N, 2D) of the block's row."""
    return torch.empty((block.row_span[1] - block.row_span[0], n, 2 * dim), dtype=block.gradient.dtype)


def copy_into(slab: torch.Tensor, blocks: list) -> None:
    """Blocks of the slab's row, each copied into place (ragged last blocks need no padding)."""
    for block in blocks:
        slab[:, block.col_span[0]:block.col_span[1]].copy_(block.gradient)


def field_label(name: str) -> str:
    if name == "dtype":  # the input's datatype is /v1's dtype
        return f"Input '{INPUT_NAME}' datatype"
    return f"Input '{INPUT_NAME}'" if name == "vectors" else f"Parameter '{name}'"


def flatten(messages, path: tuple[str, ...] = ()) -> str:
    """{"inputs": {0: {"shape": ["Not a valid integer."]}}} -> "inputs.0.shape: Not a valid integer." """
    if isinstance(messages, dict):
        return " ".join(flatten(value, path if key == "_schema" else (*path, str(key)))
                        for key, value in messages.items())
    text = " ".join(map(flatten, messages)) if isinstance(messages, list) else str(messages)
    return f"{'.'.join(path)}: {text}" if path else text
