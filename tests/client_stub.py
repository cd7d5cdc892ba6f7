"""A scripted HTTP server on loopback for the client's retry tests: each request takes the
next action of a script (an answer, a cut answer, a closed connection, a stall)."""
import contextlib
import http.server
import threading
from dataclasses import dataclass, field


@dataclass
class Answer:
    status: int = 200
    body: bytes = b"{}"
    headers: dict = field(default_factory=dict)
    cut: bool = False  # announce the whole length, send half of it, close


@dataclass
class Close:
    """Read the request and close the connection without a byte of answer."""


@dataclass
class Stall:
    """Answer nothing until the test ends."""


class Stub:
    def __init__(self, script: list):
        self.script = list(script)
        self.requests: list[tuple[str, str, int]] = []  # (method, path, client port)
        self.release = threading.Event()
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, so connection reuse can be seen

            def log_message(self, *args):
                pass

            def do_GET(self):
                self.serve()

            def do_POST(self):
                self.serve()

            def serve(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                stub.requests.append((self.command, self.path, self.client_address[1]))
                action = stub.script.pop(0) if stub.script else Answer(500, b'{"error": "script ran out"}')
                if isinstance(action, Close):
                    self.close_connection = True
                    return
                if isinstance(action, Stall):
                    stub.release.wait(30)
                    self.close_connection = True
                    return
                self.send_response(action.status)
                for name, value in {"Content-Type": "application/json", **action.headers}.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(action.body)))
                self.end_headers()
                if action.cut:
                    self.wfile.write(action.body[:len(action.body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(action.body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"


@contextlib.contextmanager
def stub_server(script: list):
    stub = Stub(script)
    thread = threading.Thread(target=stub.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield stub
    finally:
        stub.release.set()
        stub.server.shutdown()
        stub.server.server_close()
        thread.join(10)
