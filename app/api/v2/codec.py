"""The binary tensor data extension: where the JSON header ends, and tensors as bytes.

Binary tensor data is little-endian, row-major, without padding, and follows the
JSON header in the order its tensors appear there; the header's length is given
by the Inference-Header-Content-Length HTTP header. Bytes become arrays with
np.frombuffer (app/core/vectors.py's decode_tensor, once the request is admitted), and arrays
become bytes straight from their own memory, a chunk at a time: never a Python object per number. The JSON side is written a slice of
numbers at a time too, so an all-JSON answer is streamed: the worker holds the
output arrays (block_gradients a slab of rows at a time, `RowSlabs`) and about one
chunk of text, never the whole document. Pure module: no Flask.
"""
from dataclasses import dataclass
from math import prod
from typing import Callable, Iterator

import numpy as np
import orjson

HEADER_LENGTH = "Inference-Header-Content-Length"
BINARY_CONTENT_TYPE = "application/octet-stream"
CHUNK_BYTES = 1024 * 1024  # WSGI wants bytes objects: copy this much at a time, never the whole tensor
# Numbers per orjson call for JSON data: at most 25 bytes each as text (-1.2345678901234567e-308,),
# so one slice stays under CHUNK_BYTES.
JSON_SLICE_NUMBERS = CHUNK_BYTES // 32
NUMPY = orjson.OPT_SERIALIZE_NUMPY


class CodecError(ValueError):
    """The body does not add up; the message says how."""


def split_body(body: bytes, header_length: str | None) -> tuple[bytes, memoryview]:
    """(JSON header, the binary data after it) of a request body."""
    if header_length is None:
        return body, memoryview(b"")
    text = header_length.strip()
    if not (text.isascii() and text.isdigit()):  # str.isdigit alone takes '²', which int() refuses
        raise CodecError(f"{HEADER_LENGTH} must be a whole number of bytes, got {header_length!r}.")
    digits = text.lstrip("0") or "0"
    if len(digits) > len(str(len(body))):  # longer than any length this body has; int() may refuse it
        raise CodecError(f"{HEADER_LENGTH} is {len(digits)} digits long but the body has only {len(body)} bytes.")
    length = int(digits)
    if length == 0:
        raise CodecError(f"{HEADER_LENGTH}: 0 (a raw binary request, with no JSON header) is not supported: "
                         "the input's two variable dimensions cannot be deduced from its size; send the header.")
    if length > len(body):
        raise CodecError(f"{HEADER_LENGTH} is {length} but the body has only {len(body)} bytes.")
    view = memoryview(body)
    return bytes(view[:length]), view[length:]


@dataclass(frozen=True)
class RowSlabs:
    """A row-major tensor made as it is written, in slabs of whole leading rows, top to bottom
    (the block gradients, a block row at a time), so it is never held whole."""
    shape: tuple[int, ...]
    dtype: np.dtype
    make: Callable[[], Iterator[np.ndarray]]  # each slab C-contiguous, shape (rows, *shape[1:])

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * self.dtype.itemsize

    def whole(self) -> np.ndarray:
        """Every slab made now, in one array (the tensor and one slab in memory at a time)."""
        array, top = np.empty(self.shape, self.dtype), 0
        for slab in self.make():
            array[top:top + len(slab)] = slab
            top += len(slab)
        return array


def slabs(array: "np.ndarray | RowSlabs") -> Iterator[np.ndarray]:
    return array.make() if isinstance(array, RowSlabs) else iter((array,))


@dataclass(frozen=True)
class OutputTensor:
    name: str
    datatype: str  # the protocol's name, e.g. FP32
    array: np.ndarray | RowSlabs
    binary: bool  # bytes after the header, or numbers in its JSON


def iter_json(head: dict, tensors: list[OutputTensor]) -> Iterator[bytes]:
    """The response's JSON document in pieces: `head`'s keys, then "outputs" with each
    output's shape and either its binary_data_size or its data, flat and row-major,
    serialised JSON_SLICE_NUMBERS at a time. Joined, the pieces are one JSON object."""
    yield orjson.dumps({**head, "outputs": []}, option=NUMPY)[:-len(b"[]}")] + b"["
    for k, tensor in enumerate(tensors):
        if k:
            yield b","
        entry = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.array.shape)}
        if tensor.binary:
            yield orjson.dumps({**entry, "parameters": {"binary_data_size": tensor.array.nbytes}})
            continue
        yield orjson.dumps({**entry, "data": []})[:-len(b"]}")]
        separator = b""
        for slab in slabs(tensor.array):
            flat = np.ascontiguousarray(slab).reshape(-1)
            for start in range(0, flat.size, JSON_SLICE_NUMBERS):
                yield separator + orjson.dumps(flat[start:start + JSON_SLICE_NUMBERS], option=NUMPY)[1:-1]
                separator = b","  # between slices; orjson's brackets cut off above
        yield b"]}"
    yield b"]}"


def iter_body(header: Iterator[bytes], payload: list[np.ndarray | RowSlabs],
              chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """The JSON header's pieces (`header`, e.g. iter_json gathered), then each tensor's bytes,
    little-endian, a slab at a time."""
    yield from header
    for array in payload:
        for slab in slabs(array):
            if slab.size and not any(slab.strides):  # one number broadcast: its bytes repeated
                yield from repeated(slab.reshape(-1)[:1].astype(slab.dtype.newbyteorder("<")).tobytes(),
                                    slab.size, chunk_bytes)
                continue
            little = np.ascontiguousarray(slab, dtype=slab.dtype.newbyteorder("<"))  # no copy on little-endian hosts
            view = memoryview(little).cast("B")  # the slab's own bytes, no copy
            for start in range(0, view.nbytes, chunk_bytes):
                yield view[start:start + chunk_bytes].tobytes()


def repeated(number: bytes, count: int, chunk_bytes: int) -> Iterator[bytes]:
    """`number` (one entry's bytes) `count` times, in pieces of about chunk_bytes."""
    per_chunk = max(1, chunk_bytes // len(number))
    whole = number * per_chunk
    for _ in range(count // per_chunk):
        yield whole
    if count % per_chunk:
        yield number * (count % per_chunk)
