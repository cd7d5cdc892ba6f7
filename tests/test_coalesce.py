"""gunicorn's response with the head sent in the same send as the first body bytes
(app/serving/coalesce.py): the bytes on the wire are exactly gunicorn's, in fewer sends."""
import pytest
from gunicorn.config import Config
from gunicorn.http.message import Request
from gunicorn.http.unreader import IterUnreader
from gunicorn.http.wsgi import Response

from app.serving.coalesce import COALESCE_BYTES, CoalescingResponse, coalesce


class Socket:
    """Records every send."""

    def __init__(self):
        self.sends: list[bytes] = []

    def sendall(self, data: bytes) -> None:
        self.sends.append(bytes(data))


def request(head: bytes) -> Request:
    return Request(Config(), IterUnreader([head]), ("127.0.0.1", 1234), 1)


GET = b"GET /x HTTP/1.1\r\nHost: t\r\n\r\n"
HEAD = b"HEAD /x HTTP/1.1\r\nHost: t\r\n\r\n"


def answer(cls, head: bytes, headers, chunks) -> list[bytes]:
    sock = Socket()
    response = Response(request(head), sock, Config())
    if cls is CoalescingResponse:
        coalesce(response.start_response)
    response.start_response("200 OK", headers)
    for chunk in chunks:
        response.write(chunk)
    response.close()
    return sock.sends


def same_bytes_fewer_sends(head, headers, chunks) -> tuple[list[bytes], list[bytes]]:
    plain = answer(Response, head, headers, chunks)
    mine = answer(CoalescingResponse, head, headers, chunks)
    # gunicorn's Date header may tick between the two answers: compare without it.
    strip = lambda sends: b"".join(sends).split(b"Date: ", 1)[0] + b"".join(sends).split(b"GMT\r\n", 1)[1]  # noqa: E731
    assert strip(mine) == strip(plain)
    return plain, mine


def test_a_small_answer_goes_out_in_one_send():
    plain, mine = same_bytes_fewer_sends(GET, [("Content-Length", "5")], [b"hello"])
    assert len(plain) == 2 and len(mine) == 1
    assert mine[0].startswith(b"HTTP/1.1 200 OK\r\n") and mine[0].endswith(b"\r\n\r\nhello")


def test_a_chunked_answer_frames_its_first_chunk_after_the_head():
    plain, mine = same_bytes_fewer_sends(GET, [], [b"abc", b"de"])
    assert len(mine) == len(plain) - 1
    assert mine[0].endswith(b"\r\n\r\n3\r\nabc\r\n") and mine[-1] == b"0\r\n\r\n"


def test_a_large_first_chunk_is_sent_after_the_head_as_before():
    body = b"x" * (COALESCE_BYTES + 1)
    plain, mine = same_bytes_fewer_sends(GET, [("Content-Length", str(len(body)))], [body])
    assert len(mine) == len(plain) == 2 and mine[1] == body


@pytest.mark.parametrize("head, chunks", [(GET, []), (HEAD, [b"dropped"])])
def test_an_answer_without_body_bytes_still_sends_its_head(head, chunks):
    plain, mine = same_bytes_fewer_sends(head, [("Content-Length", "7")], chunks)
    assert len(mine) == len(plain) == 1 and mine[0].endswith(b"\r\n\r\n")

