"""Shared pieces of streamed answers: tensors to arrays, small pieces gathered into chunks,
closing a wrapped body."""
from collections.abc import Iterator

import numpy as np
import orjson
import torch

NUMPY = orjson.OPT_SERIALIZE_NUMPY


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    # One torch call (detach and copy to the host); orjson needs C-contiguous arrays and
    # autograd may hand back expanded views, copied by numpy only then.
    array = tensor.numpy(force=True)
    return array if array.flags.c_contiguous else array.copy(order="C")


def json_array(tensor: torch.Tensor) -> np.ndarray | orjson.Fragment:
    """The tensor as orjson writes it (OPT_SERIALIZE_NUMPY): an array, or, for one number
    broadcast (autograd's gradient of sum and mean: every stride 0), that number's text as
    orjson writes it, repeated: the same bytes without formatting each entry."""
    strides = tensor.stride()
    if not strides or any(strides):
        return to_numpy(tensor)
    array = tensor.numpy(force=True)  # a view: every stride 0
    text = orjson.dumps(array.reshape(-1)[:1], option=NUMPY)[1:-1]  # the number, as orjson writes it
    for size in reversed(array.shape):  # innermost dimension first
        text = b"[" + b",".join([text] * size) + b"]"
    return orjson.Fragment(text)


def close_body(body: object) -> None:
    """PEP 3333: whoever wraps a body passes the server's close() on to it, when it has one."""
    close = getattr(body, "close", None)
    if close is not None:
        close()


def gather(pieces: Iterator[bytes], chunk_bytes: int) -> Iterator[bytes]:
    """Small pieces joined into chunks of about chunk_bytes; a piece that big goes out alone,
    as it was made, without being copied into a chunk."""
    buffer, size = [], 0
    for piece in pieces:
        if len(piece) >= chunk_bytes:
            if buffer:
                yield b"".join(buffer)
                buffer, size = [], 0
            yield piece
            continue
        buffer.append(piece)
        size += len(piece)
        if size >= chunk_bytes:
            yield b"".join(buffer)
            buffer, size = [], 0
    if buffer:
        yield b"".join(buffer)
