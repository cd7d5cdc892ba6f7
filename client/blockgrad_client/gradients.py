"""/v1/gradients' answer, read as it streams in.

The answer is one JSON object: the head's keys (n, dim, factor, bounds, objective,
dtype, device, accumulated, losses) first, then "blocks": [...], written by the server
block by block as it computes them. ijson's incremental parser reads it from the
socket a buffer at a time, and each block becomes numpy arrays as soon as it is
complete, so the answer is never held twice (as text and as arrays) and a consumer
of `iter_gradient_answer` holds one block at a time.
"""
from collections.abc import Iterator
from dataclasses import dataclass, field

import ijson
import numpy as np

READ_BYTES = 64 * 1024
HEAD_ARRAYS = {"accumulated", "losses"}  # arrays in the answer's dtype


@dataclass(frozen=True)
class Block:
    """Block (row, col) of the F x F grid: V rows [rows[0], rows[1]) against V rows [cols[0], cols[1])."""
    row: int
    col: int
    rows: tuple[int, int]
    cols: tuple[int, int]
    loss: float
    gradient: np.ndarray  # (rows, cols, 2D), dL/dB in the answer's dtype


@dataclass
class GradientResult:
    n: int
    dim: int
    factor: int
    bounds: np.ndarray  # (F + 1,) int64
    objective: str
    dtype: str
    device: str
    accumulated: np.ndarray | None = None  # (N, D), when asked for
    losses: np.ndarray | None = None  # (F, F), when asked for
    blocks: list[Block] = field(default_factory=list)  # F*F, row-block-major, when asked for


def to_block(item: dict, dtype: np.dtype) -> Block:
    return Block(row=item["row"], col=item["col"], rows=tuple(item["rows"]), cols=tuple(item["cols"]),
                 loss=float(item["loss"]), gradient=np.asarray(item["gradient"], dtype=dtype))


def to_head(head: dict) -> dict:
    """The head's values as the result keeps them: lists become arrays."""
    dtype = np.dtype(head.get("dtype", "float32"))
    out = dict(head)
    out["bounds"] = np.asarray(head["bounds"], dtype=np.int64)
    for name in HEAD_ARRAYS & head.keys():
        out[name] = np.asarray(head[name], dtype=dtype)
    return out


def iter_gradient_answer(raw) -> tuple[dict, Iterator[Block]]:
    """(head, blocks): the head's keys as arrays, and an iterator over the blocks that reads
    on from `raw` (anything with read(n)) as it is advanced. ijson raises
    ijson.IncompleteJSONError (a subclass of ijson.JSONError) if the answer stops short."""
    events = ijson.parse(raw, buf_size=READ_BYTES, use_float=True)
    head: dict = {}
    for prefix, event, value in events:
        if prefix != "" or event != "map_key":
            continue
        if value == "blocks":  # the server writes it last: from here on, one block at a time
            dtype = np.dtype(head.get("dtype", "float32"))
            blocks = (to_block(item, dtype) for item in ijson.items(events, "blocks.item"))
            return to_head(head), finish(blocks, events)
        head[value] = next(ijson.items(events, value))  # this key's whole value, built by ijson
    return to_head(head), iter(())


def finish(blocks: Iterator[Block], events) -> Iterator[Block]:
    """The blocks, then the rest of the document, so that a missing closing `]}` is an error."""
    yield from blocks
    for _ in events:
        pass


def collect(head: dict, blocks) -> GradientResult:
    known = {name: head[name] for name in GradientResult.__dataclass_fields__ if name in head}
    return GradientResult(**known, blocks=list(blocks))
