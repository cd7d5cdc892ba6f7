"""ModelInferRequest -> the pipeline's Described (through /v2's own checks) -> ModelInferResponse.

A message is described as the /v2 document it stands for, its tensor bytes as /v2's binary
tensor data: the same names, rules and messages. Answers are raw tensors (every output in
`raw_output_contents`, what tritonclient's `as_numpy` reads), so the whole answer is one
message, held whole: its size is refused before computing (`check_message`). It is
serialised here, each output's bytes copied once from its arrays into the message.
"""
from dataclasses import replace

import numpy as np
from tritonclient.grpc import service_pb2 as pb

from ...core.admission import output_elements
from ...core.dtypes import DTYPES, WIDEST
from ...core.errors import invalid_request, limit_exceeded
from ...core.request import Sizes
from ...http.pipeline import Computed, Described
from ..v2.codec import slabs
from ..v2.infer import describe, output_tensors
from ..v2.model import FLOAT_DATATYPES

TYPED_CONTENTS = {"FP32": "fp32_contents", "FP64": "fp64_contents"}
MESSAGE_MARGIN_BYTES = 64 * 1024  # names, shapes and parameters beside the tensors' bytes
COPIES = 2  # an output's slabs and the message, then the message and grpcio's copy of it
PARAMETER_FIELDS = {str: "string_param", int: "int64_param", float: "double_param"}
# The key of a raw_output_contents entry on the wire: its field number, wire type 2 (bytes).
RAW_OUTPUT_KEY = bytes([pb.ModelInferResponse.DESCRIPTOR.fields_by_name["raw_output_contents"].number << 3 | 2])


def value(parameter: pb.InferParameter):
    return getattr(parameter, parameter.WhichOneof("parameter_choice") or "bool_param")  # unset: False


def decode(message: pb.ModelInferRequest) -> Described:
    """Inputs in `raw_input_contents` or in the typed contents of their datatype."""
    inputs, data = [], b""
    for k, tensor in enumerate(message.inputs):
        typed = getattr(tensor.contents, TYPED_CONTENTS.get(tensor.datatype, "fp32_contents"))
        if k < len(message.raw_input_contents):
            if typed:
                raise invalid_request(f"Input {tensor.name!r} has both typed contents and raw_input_contents; send one.")
            data = message.raw_input_contents[k]
        elif typed and tensor.datatype in FLOAT_DATATYPES:
            data = np.asarray(typed, dtype=FLOAT_DATATYPES[tensor.datatype][0]).tobytes()
        parameters = {key: value(p) for key, p in tensor.parameters.items()}
        inputs.append({"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape),
                       "parameters": {**parameters, "binary_data_size": len(data)}})
    if len(message.raw_input_contents) > len(message.inputs):
        raise invalid_request(f"{len(message.raw_input_contents)} raw_input_contents for {len(message.inputs)} inputs.")
    document = {"inputs": inputs, "parameters": {**{key: value(p) for key, p in message.parameters.items()},
                                                 "binary_data_output": True}}
    if message.outputs:
        document["outputs"] = [{"name": o.name, "parameters": {key: value(p) for key, p in o.parameters.items()}}
                               for o in message.outputs]
    if message.id:
        document["id"] = message.id
    described = describe(document, memoryview(data), len(data), binary_input=True)
    held = COPIES * DTYPES[described.fields["dtype"]].item_bytes  # bytes per output number
    cost = replace(described.answer, block_row_per_number=0, head_per_number=held,
                   grid_per_number=held if any(output.name == "block_gradients" for output in described.own[0]) else 0)
    return replace(described, answer=cost)


def check_message(sizes: Sizes, limit: int) -> None:
    """The answer, one message, must fit the message limit: refused before any computing."""
    if sizes.factor is None or sizes.outputs is None:
        return  # refused when converted
    item = DTYPES.get(sizes.dtype, WIDEST).item_bytes
    nbytes = output_elements(sizes.n, sizes.dim, sizes.factor, sizes.outputs) * item
    nbytes += 8 * (sizes.factor + 1) + MESSAGE_MARGIN_BYTES  # bounds
    if nbytes > limit:
        raise limit_exceeded(f"The answer would be a {nbytes}-byte message, over BLOCKGRAD_GRPC_MAX_MESSAGE_BYTES = "
                             f"{limit}; ask for fewer outputs (block_gradients is N x N x 2D numbers), send fewer "
                             "vectors, or use /v2 (streamed) or /v1/jobs.",
                             "BLOCKGRAD_GRPC_MAX_MESSAGE_BYTES", nbytes, limit)


def render(computed: Computed) -> bytes:
    """The serialised ModelInferResponse: the head by protobuf, then each raw_output_contents
    entry as the wire has it (key, length, bytes; a parser appends entries in the order they
    come, after any other field), joined once from the output arrays' memory."""
    head, tensors = output_tensors(computed.request, *computed.own, computed.result, computed.device, computed.timed)
    response = pb.ModelInferResponse(model_name=head["model_name"], model_version=head["model_version"],
                                     id=head.get("id", ""))
    for key, item in head["parameters"].items():  # factor, objective, offset (an int or a float), device
        setattr(response.parameters[key], PARAMETER_FIELDS[type(item)], item)
    raw = []
    for tensor in tensors:
        response.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.array.shape)
        parts = [np.ascontiguousarray(slab, slab.dtype.newbyteorder("<")) for slab in slabs(tensor.array)]
        raw += [RAW_OUTPUT_KEY + varint(sum(part.nbytes for part in parts)), *parts]
    return b"".join([response.SerializeToString(), *raw])


def varint(number: int) -> bytes:
    """Protobuf's base-128 varint: seven bits a byte, low first, the high bit on all but the last."""
    groups = [number >> shift & 0x7F for shift in range(0, max(number.bit_length(), 1), 7)]
    return bytes([group | 0x80 for group in groups[:-1]] + groups[-1:])
