"""gunicorn's response, with the head sent together with the first body bytes.

gunicorn writes an answer's head and its body in two sends: two system calls (each with a poll
while the socket has a send timeout) and two TCP segments for the client to read. A small
answer goes out in one here. The head is still sent when the first body bytes are (gunicorn
sends it on the first write too), so nothing about when a client sees its answer changes;
an answer without a body, or a file sent with sendfile, gets its head as before.

The master loads this module (through app/serving/worker.py): gunicorn only.
"""
from gunicorn import util
from gunicorn.http import wsgi

# Body bytes sent in the head's send at most: past this, copying them after the head costs
# more than the second send.
COALESCE_BYTES = 64 * 1024


class _Capture:
    """Stands in for the socket while gunicorn writes the head."""

    def __init__(self):
        self.data = b""

    def sendall(self, data: bytes) -> None:
        self.data += data


class CoalescingResponse(wsgi.Response):
    pending = b""  # the head, written but not yet sent
    coalescing = True

    def send_headers(self):
        if self.headers_sent or not self.coalescing:
            return super().send_headers()
        sock, capture = self.sock, _Capture()
        self.sock = capture
        try:
            super().send_headers()
        finally:
            self.sock = sock
        self.pending = capture.data

    def _emit_body(self, data):
        head, self.pending = self.pending, b""
        if not head:
            return super()._emit_body(data)
        if len(data) > COALESCE_BYTES:
            util.write(self.sock, head)
            return super()._emit_body(data)
        body = b"".join((b"%X\r\n" % len(data), data, b"\r\n")) if self.chunked else data
        util.write(self.sock, head + body)

    def flush_head(self) -> None:
        head, self.pending = self.pending, b""
        if head:
            util.write(self.sock, head)

    def sendfile(self, respiter):
        self.flush_head()
        self.coalescing = False  # os.sendfile writes the body straight to the socket
        return super().sendfile(respiter)

    def close(self):
        if not self.headers_sent:
            self.send_headers()
        self.flush_head()  # an answer without body bytes
        super().close()


def coalesce(start_response) -> None:
    """Make the gunicorn response behind a WSGI `start_response` a CoalescingResponse."""
    response = getattr(start_response, "__self__", None)
    if type(response) is wsgi.Response:
        response.__class__ = CoalescingResponse
