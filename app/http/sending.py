"""Writing an answer: a socket timeout on writes, and bodies handed to the server in pieces.

With the timeout set and no write larger than PIECE_BYTES, a write that times out has made
no progress for about BLOCKGRAD_SEND_TIMEOUT_S.
"""
from collections.abc import Iterator
from typing import Any

from .connection import set_send_timeout

PIECE_BYTES = 1024 * 1024


def start_sending(environ: dict[str, Any], send_timeout_s: float) -> None:
    """From here on the socket only writes: each write may wait up to `send_timeout_s`."""
    set_send_timeout(environ, send_timeout_s)


def pieces(item: bytes) -> Iterator[bytes]:
    if len(item) <= PIECE_BYTES:
        yield item
        return
    view = memoryview(item)
    for start in range(0, len(item), PIECE_BYTES):
        yield bytes(view[start:start + PIECE_BYTES])
