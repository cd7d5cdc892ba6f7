"""Writing an answer: tensors to JSON-ready arrays, small pieces gathered into chunks, bodies
handed to the server in pieces under a send timeout, and why a streamed body ended early.

With a socket timeout on writes (set by record.after_request) and no write larger than
PIECE_BYTES, a write that times out made no progress for about BLOCKGRAD_SEND_TIMEOUT_S;
record.drop_connection shuts a gone client's socket instead of writing (client_closed). Codes only the log line and the errors
metric carry (never an answer's body): `client_closed` (the client went away), `send_timeout`
(a write made no progress for the send timeout), or the error that stopped the computation
between two blocks.
"""
import time
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import orjson
import torch

from ..core.errors import BlockgradError

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


PIECE_BYTES = 1024 * 1024


def pieces(item: bytes) -> Iterator[bytes]:
    if len(item) <= PIECE_BYTES:
        yield item
        return
    view = memoryview(item)
    for start in range(0, len(item), PIECE_BYTES):
        yield bytes(view[start:start + PIECE_BYTES])


SEND_TIMEOUT_SHARE = 0.9  # a write that failed this late into the timeout was the timeout


class WatchedBody:
    """The answer's body in pieces of at most PIECE_BYTES; calls `finish` once, from `close`
    or after the last piece, with what cut it short: the inner body's error (e.g.
    deadline_exceeded or client_closed between two blocks), or a write that failed
    (`send_timeout` if it had waited for most of the send timeout, else `client_closed`)."""

    def __init__(self, body: Iterable[bytes], finish: Callable[[str | None], None], send_timeout_s: float):
        self.body, self.finish, self.send_timeout_s = body, finish, send_timeout_s
        self.started = self.complete = False
        self.error: str | None = None
        self.handed_at = 0.0

    def __iter__(self) -> Iterator[bytes]:
        self.started = True
        try:
            for item in self.body:
                for piece in pieces(item):
                    self.handed_at = time.monotonic()
                    yield piece
        except Exception as exc:
            self.error = exc.code if isinstance(exc, BlockgradError) else "internal_error"
            self.finish(self.error)
            raise
        self.complete = True
        self.finish(None)  # now, not at close: the count and log line follow the last byte

    def close(self) -> None:
        try:  # PEP 3333: whoever wraps a body passes the server's close() on to it, when it has one
            close = getattr(self.body, "close", None)
            if close is not None:
                close()
        finally:
            error = self.error
            if error is None and self.started and not self.complete:  # the server stopped writing
                late = time.monotonic() - self.handed_at >= SEND_TIMEOUT_SHARE * self.send_timeout_s
                error = "send_timeout" if late else "client_closed"
            self.finish(error)
