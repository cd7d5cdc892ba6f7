"""The binary tensor data extension: where the JSON header ends, and tensors as bytes.

Binary tensor data is little-endian, row-major, without padding, and follows the
JSON header in the order its tensors appear there; the header's length is given
by the Inference-Header-Content-Length HTTP header. Bytes become arrays with
np.frombuffer, and arrays become bytes straight from their own memory, a chunk at
a time: never a Python object per number. Pure module: no Flask.
"""
from dataclasses import dataclass
from math import prod
from typing import Iterator

import numpy as np
import orjson

HEADER_LENGTH = "Inference-Header-Content-Length"
BINARY_CONTENT_TYPE = "application/octet-stream"
CHUNK_BYTES = 1024 * 1024  # WSGI wants bytes objects: copy this much at a time, never the whole tensor


class CodecError(ValueError):
    """The body does not add up; the message says how."""


def split_body(body: bytes, header_length: str | None) -> tuple[bytes, memoryview]:
    """(JSON header, the binary data after it) of a request body."""
    if header_length is None:
        return body, memoryview(b"")
    text = header_length.strip()
    if not (text.isascii() and text.isdigit()):  # str.isdigit alone takes '²', which int() refuses
        raise CodecError(f"{HEADER_LENGTH} must be a whole number of bytes, got {header_length!r}.")
    length = int(text)
    if length == 0:
        raise CodecError(f"{HEADER_LENGTH}: 0 (a raw binary request, with no JSON header) is not supported: "
                         "the input's two variable dimensions cannot be deduced from its size; send the header.")
    if length > len(body):
        raise CodecError(f"{HEADER_LENGTH} is {length} but the body has only {len(body)} bytes.")
    view = memoryview(body)
    return bytes(view[:length]), view[length:]


def decode_tensor(buffer: memoryview, dtype: np.dtype, shape: list[int]) -> np.ndarray:
    """A tensor's binary data -> a writable array of that shape, in native byte order."""
    expected = prod(shape) * dtype.itemsize
    if len(buffer) != expected:
        raise CodecError(f"Shape {shape} of {dtype.itemsize}-byte numbers takes {expected} bytes, "
                         f"but {len(buffer)} were sent.")
    try:
        # A copy (of the input, small next to the output): torch will not share read-only memory.
        return np.frombuffer(buffer, dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="))
    except (ValueError, OverflowError) as exc:  # e.g. a dimension past what numpy can index
        raise CodecError(f"Shape {shape} cannot be read as a tensor: {exc}.") from None


@dataclass(frozen=True)
class OutputTensor:
    name: str
    datatype: str  # the protocol's name, e.g. FP32
    array: np.ndarray
    binary: bool  # bytes after the header, or numbers in its JSON


def encode_response(head: dict, tensors: list[OutputTensor]) -> tuple[bytes, list[np.ndarray]]:
    """The JSON header (with every output's shape, and its data or binary_data_size),
    and the arrays whose bytes follow it, in order."""
    outputs, payload = [], []
    for tensor in tensors:
        entry = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.array.shape)}
        if tensor.binary:
            array = np.ascontiguousarray(tensor.array, dtype=tensor.array.dtype.newbyteorder("<"))
            entry["parameters"] = {"binary_data_size": array.nbytes}
            payload.append(array)
        else:
            entry["data"] = np.ascontiguousarray(tensor.array).reshape(-1)  # flat, row-major
        outputs.append(entry)
    header = orjson.dumps({**head, "outputs": outputs}, option=orjson.OPT_SERIALIZE_NUMPY)
    return header, payload


def body_length(header: bytes, payload: list[np.ndarray]) -> int:
    return len(header) + sum(array.nbytes for array in payload)


def iter_body(header: bytes, payload: list[np.ndarray], chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    yield header
    for array in payload:
        view = memoryview(array).cast("B")  # the array's own bytes, no copy
        for start in range(0, view.nbytes, chunk_bytes):
            yield view[start:start + chunk_bytes].tobytes()
