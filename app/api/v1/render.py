"""/v1's answer as JSON bytes (orjson), the blocks streamed one at a time.

The head (sizes, bounds, accumulated, losses) goes out first; then each block
is serialised as it is taken from the result and flushed in chunks of about
CHUNK_BYTES, so a worker holds roughly one block of output at a time whatever N is.
A small answer (WHOLE_ANSWER_NUMBERS) whose blocks are all computed is sent whole instead.
"""
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import orjson

from ...core.admission import output_elements
from ...core.engine import Block
from ...core.run import Result
from ...http.streaming import NUMPY, gather, json_array, to_numpy

CHUNK_BYTES = 256 * 1024
# An answer of at most this many numbers whose blocks were kept from pass one (computed and
# proven finite) goes out whole, with a Content-Length, in one write instead of a chunk per
# piece. Under 1 MiB of JSON even for 1 x 1 blocks (~75 bytes per number with the keys),
# inside the memory prediction's FIXED_BYTES.
WHOLE_ANSWER_NUMBERS = 8192


def block_json(block: Block) -> bytes:
    return orjson.dumps({
        "row": block.r, "col": block.c,
        "rows": block.row_span, "cols": block.col_span,
        "loss": to_numpy(block.loss)[()],  # numpy scalar: shortest digits of its dtype
        "gradient": json_array(block.gradient),  # (rows, cols, 2D)
    }, option=NUMPY)


def head_json(head: dict) -> bytes:
    return orjson.dumps(head, option=NUMPY)


def answer_head(result: Result) -> dict:
    """Every field of the answer but its blocks."""
    req = result.request
    head = {"n": req.n, "dim": req.dim, "factor": req.factor, "bounds": result.bounds,
            "objective": req.objective, "dtype": req.dtype, "device": str(result.device)}
    if "accumulated" in req.outputs:
        head["accumulated"] = to_numpy(result.accumulated)
    if "losses" in req.outputs:
        head["losses"] = to_numpy(result.losses)
    return head


def render_result(result: Result, timed: Callable[[Iterable], Iterator] = iter) -> bytes | Iterator[bytes]:
    """The whole document; streamed (an iterator) when it holds blocks, unless it is small
    and they are all computed. `timed` wraps the blocks as they are taken (compute time)."""
    req = result.request
    head = answer_head(result)
    if "blocks" not in req.outputs:
        return head_json(head)
    numbers = output_elements(req.n, req.dim, req.factor, req.outputs)
    if result.kept is not None and numbers <= WHOLE_ANSWER_NUMBERS:
        return whole_json(head, to_numpy(result.losses), timed(result.blocks()))
    return stream_with_blocks(head, timed(result.blocks()))


def whole_json(head: dict, losses: np.ndarray, blocks: Iterator[Block]) -> bytes:
    """The head and every block in one orjson call: the bytes the stream would join to.
    A block's loss is read from `losses` (F, F), the same numbers as its own 0-d tensor."""
    return orjson.dumps(dict(head, blocks=[{
        "row": block.r, "col": block.c,
        "rows": block.row_span, "cols": block.col_span,
        "loss": losses[block.r, block.c],
        "gradient": json_array(block.gradient),
    } for block in blocks]), option=NUMPY)


def stream_with_blocks(head: dict, blocks: Iterator[Block]) -> Iterator[bytes]:
    """One JSON object: the head's keys, then "blocks": [...] written as computed.

    The head goes out before any block is computed, so the status line and
    headers are sent first: a failure after that (deadline, device memory) can
    only cut the stream, and the client sees a body without its closing "]}"
    (and, over HTTP/1.1, without the final chunk), never a complete wrong one.
    """
    yield head_json(head)[:-1] + b',"blocks":['
    yield from gather(block_pieces(blocks), CHUNK_BYTES)


def block_pieces(blocks: Iterator[Block]) -> Iterator[bytes]:
    for k, block in enumerate(blocks):
        if k:
            yield b","
        yield block_json(block)
    yield b"]}"
