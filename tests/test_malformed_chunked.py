"""Malformed chunked bodies against real gunicorn: its parser's errors surface while the
app reads the body and must be 400 bad_request in the JSON error body, never a 500 with a
traceback (issue 11). Raw sockets: http.client would not send these bytes."""
import socket

import orjson
import pytest

from tools.server import gunicorn_server

pytestmark = pytest.mark.slow

HEAD = (b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
GOOD = b'{"vectors":[[1.0,2.0],[3.0,4.0]],"factor":1}'
CASES = {
    "chunk size zz": b"zz\r\n" + GOOD + b"\r\n0\r\n\r\n",
    "chunk without its CRLF": b"%x\r\n" % len(GOOD) + GOOD + b"XX0\r\n\r\n",
    "chunk extension over 8190 bytes": b"%x;ext=" % len(GOOD) + b"a" * 100_000 + b"\r\n" + GOOD + b"\r\n0\r\n\r\n",
    "body ends before the last chunk": b"%x\r\n" % (len(GOOD) + 100) + GOOD,
}


def raw_exchange(port: int, data: bytes, half_close: bool) -> tuple[int, dict[str, str], bytes]:
    """Send `data`, read until the server closes (bounded by the socket timeout)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(data)
        if half_close:
            try:
                sock.shutdown(socket.SHUT_WR)
            except OSError:  # the server has answered and closed already
                pass
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
                if len(received) > 1_000_000:
                    break
        except ConnectionResetError:  # closed after its answer, with our unread bytes pending
            pass
    head, _, body = received.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), headers, body


@pytest.fixture(scope="module")
def server():
    with gunicorn_server(workers=1) as server:
        yield server


@pytest.mark.parametrize("path", ["/v1/gradients", "/v2/models/blockgrad/infer"])
@pytest.mark.parametrize("case", list(CASES))
def test_malformed_chunked_body_is_bad_request(server, path, case):
    status, headers, body = raw_exchange(server.port, HEAD % path.encode() + CASES[case],
                                         half_close=case == "body ends before the last chunk")
    assert status == 400, body[:300]
    assert headers.get("X-Blockgrad-Error-Code") == "bad_request"
    document = orjson.loads(body)
    message = document["error"]["message"] if path.startswith("/v1") else document["error"]
    assert len(message) > 10  # gunicorn's parse errors name the parser's exception; werkzeug's its own


def test_no_traceback_and_the_worker_serves_on(server):
    for case in CASES.values():
        raw_exchange(server.port, HEAD % b"/v1/gradients" + case, half_close=True)
    status, _, body = raw_exchange(server.port, HEAD % b"/v1/gradients" + b"%x\r\n" % len(GOOD) + GOOD
                                   + b"\r\n0\r\n\r\n", half_close=False)
    assert status == 200
    log = server.log()
    assert "Traceback" not in log and "unhandled error" not in log
