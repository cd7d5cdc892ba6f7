"""Serialise results to JSON bytes with orjson, streaming blocks one at a time.

The head (sizes, bounds, accumulated, losses) goes out first; then each block
is serialised as it is computed and flushed in chunks of about CHUNK_BYTES, so
a worker holds roughly one block of output at a time whatever N is.
"""
from typing import Iterator

import numpy as np
import orjson
import torch

from .engine import Block

NUMPY = orjson.OPT_SERIALIZE_NUMPY
CHUNK_BYTES = 256 * 1024


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    # orjson needs C-contiguous arrays; autograd may hand back expanded views.
    return tensor.detach().cpu().contiguous().numpy()


def block_json(block: Block) -> bytes:
    return orjson.dumps({
        "row": block.row, "col": block.col,
        "rows": block.rows, "cols": block.cols,
        "loss": to_numpy(block.loss)[()],  # numpy scalar: shortest digits of its dtype
        "gradient": to_numpy(block.gradient),  # (rows, cols, 2D)
    }, option=NUMPY)


def head_json(head: dict) -> bytes:
    return orjson.dumps(head, option=NUMPY)


def stream_with_blocks(head: dict, blocks: Iterator[Block]) -> Iterator[bytes]:
    """One JSON object: the head's keys, then "blocks": [...] written as computed.

    The head goes out before any block is computed, so the status line and
    headers are sent first: a failure after that (deadline, device memory) can
    only cut the stream, and the client sees a body without its closing "]}"
    (and, over HTTP/1.1, without the final chunk), never a complete wrong one.
    Small blocks are gathered into chunks of about CHUNK_BYTES; a block that big on
    its own goes out as orjson made it, without being copied into a chunk.
    """
    yield head_json(head)[:-1] + b',"blocks":['
    yield from gather(block_pieces(blocks), CHUNK_BYTES)


def block_pieces(blocks: Iterator[Block]) -> Iterator[bytes]:
    for k, block in enumerate(blocks):
        if k:
            yield b","
        yield block_json(block)
    yield b"]}"


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
