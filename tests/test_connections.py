"""The service's own edge (app/serving/worker.py) against real gunicorn: idle floods, header
slowloris, silent closes, the header and read clocks, and the connection bound.

Verdicts count events (probes answered, connections closed and how, which closed first); how
fast probes are answered under attack is measured by `make bench` (bench/attacks.py), not here.
A lower bound ("not closed before the header timeout") is read on the client's clock, which
starts before the server's: a slow machine only makes it longer.
"""
import http.client
import json
import re
import select
import socket
import time

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from bench.attacks import DRIP_HEAD, HeaderDrip, IdleFlood, Prober, raise_open_files
from tools.server import gunicorn_server, wait_until
from .test_api import GOOD
from .events import connection_owner

pytestmark = pytest.mark.slow

WAIT_S = 60  # bound of every wait below; reached only on failure
BODY = json.dumps(GOOD).encode()


def scrape(server, session=requests) -> dict:
    text = session.get(server.url + "/metrics", timeout=WAIT_S).text
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def closes(server, reason: str, session=requests) -> float:
    return scrape(server, session).get(("blockgrad_connections_closed_total", (("reason", reason),)), 0.0)


def connect(server, timeout: float = WAIT_S) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=timeout)


def eof_at(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (bounded by the socket's timeout)."""
    received = b""
    while True:
        data = sock.recv(65536)
        if not data:
            return received
        received += data


def readable(socks: list[socket.socket]) -> list[socket.socket]:
    """Those of `socks` with data or EOF waiting (poll: descriptors past 1024 too)."""
    poller = select.poll()
    for sock in socks:
        poller.register(sock.fileno(), select.POLLIN)
    ready = {fd for fd, _ in poller.poll(0)}
    return [sock for sock in socks if sock.fileno() in ready]


def closed_without_a_word(sock: socket.socket) -> bool:
    """Readable now and at EOF with no byte."""
    return bool(readable([sock])) and sock.recv(1) == b""


def probed(port: int, seconds: float) -> Prober:
    """Probes that each wait up to WAIT_S for their answer: a verdict on answers, not latency."""
    return Prober(port, BODY, seconds=seconds, timeout_s=WAIT_S)


def assert_probes_answered(prober: Prober) -> None:
    """Every probe (/healthz and the 10 x 5 request, each on a fresh connection) got its 200."""
    assert all(len(values) >= 1 for values in prober.latencies.values()), prober.latencies
    failed = [x for x in prober.all() if x is None]
    assert not failed, f"{len(failed)} of {len(prober.all())} probes got no 200"


@pytest.fixture(scope="module")
def short():
    """Header timeout 2 s, two workers."""
    with gunicorn_server(workers=2, env={"BLOCKGRAD_HEADER_TIMEOUT_S": "2"}) as server:
        yield server


def test_an_idle_flood_does_not_freeze_probes():
    """1500 idle connections at once, then up to 40 more a second for 15 s, at the defaults (2
    workers, header timeout 10 s): /healthz and the 10 x 5 request on fresh connections are
    all answered; the server really held the flood, and closed it without a word."""
    raise_open_files(4096)
    with gunicorn_server(workers=2) as server:
        with IdleFlood(server.port, initial=1500, per_second=40, seconds=15) as flood:
            with probed(server.port, seconds=15) as prober:
                prober.join()
            assert flood.opened >= 1500 and flood.failed == 0  # the growth's rate is the machine's
            assert_probes_answered(prober)
            first = flood.sockets[:1500]
            assert wait_until(lambda: len(readable(first)) == len(first), WAIT_S, 0.5)
            assert all(sock.recv(1) == b"" for sock in first)  # closed, nothing written
        # The initial flood reached the workers and was closed there without a request: a count,
        # where sampling the open gauge would depend on how fast the workers accept.
        # (the flood's last connections, younger than the header timeout, close from the client's side)
        assert closes(server, "no_request") + closes(server, "evicted") >= 1500
        # No log line per connection: only the probes' request lines and gunicorn's start-up.
        other = [line for line in server.log().splitlines() if not line.startswith('{"ts"')]
        assert len(other) < 50, other[-10:]


def test_header_slowloris_is_cut_at_the_header_timeout_and_probes_answer(short):
    """200 connections sending their heads a byte a second: each is closed once 2 s have passed
    since it connected, with 408 read_timeout if a byte of it had arrived (counted head_timeout)
    or without a word if none had (counted no_request), and probes are answered meanwhile."""
    before = {reason: closes(short, reason) for reason in ("head_timeout", "no_request")}
    with HeaderDrip(short.port, count=200, seconds=WAIT_S) as drip:
        with probed(short.port, seconds=8) as prober:
            prober.join()
        assert wait_until(lambda: not drip.live(), WAIT_S, 0.5), f"{len(drip.live())} drippers still open"
    assert len(drip.drippers) == 200
    assert_probes_answered(prober)
    answered = 0
    for dripper in drip.drippers:
        assert dripper.closed_at - dripper.opened_at >= 2.0  # never before the header timeout
        assert dripper.sent < len(DRIP_HEAD)  # never a whole head
        if dripper.received:
            assert dripper.received.startswith(b"HTTP/1.1 408 ")
            body = json.loads(dripper.received.split(b"\r\n\r\n", 1)[1])
            assert body["error"]["code"] == "read_timeout" and body["error"]["details"] == {"timeout_s": 2.0}
            answered += 1
    # Which drippers had a byte in before their 2 s is the machine's pace; that each close has
    # its reason is not (the probes send whole requests at once: neither reason).
    assert answered >= 1
    assert closes(short, "head_timeout") == before["head_timeout"] + answered
    assert closes(short, "no_request") == before["no_request"] + 200 - answered


def test_a_connection_that_sends_nothing_is_closed_silently(short):
    before = closes(short, "no_request")
    start = time.monotonic()
    with connect(short) as sock:
        assert eof_at(sock) == b""
    assert time.monotonic() - start >= 2.0
    assert closes(short, "no_request") >= before + 1


def test_a_kept_alive_connection_s_clock_starts_at_its_next_byte(short):
    """Idle past the header timeout is fine (keep-alive is 75 s); a partial next head then
    gets its 408 once 2 s have passed since its first byte."""
    with connect(short) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        first = http.client.HTTPResponse(sock)
        first.begin()
        assert first.status == 200 and first.read() == b'{"status":"ok"}\n'
        time.sleep(3)  # longer than the header timeout, idle
        assert not readable([sock]), "an idle kept-alive connection was closed"
        sent = time.monotonic()
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n")
        answer = eof_at(sock)
        assert time.monotonic() - sent >= 2.0
    assert answer.startswith(b"HTTP/1.1 408 ") and b'"code":"read_timeout"' in answer


def ask_healthz(sock: socket.socket) -> None:
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
    answer = http.client.HTTPResponse(sock)
    answer.begin()
    assert answer.status == 200 and answer.read() == b'{"status":"ok"}\n'


def test_a_partial_next_head_right_after_an_answer_still_gets_its_408(short):
    """Part of the next head, sent at once after an answer, waits in the poller and is cut 2 s
    after it arrived."""
    with connect(short) as sock:
        ask_healthz(sock)
        sent = time.monotonic()
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n")
        answer = eof_at(sock)
        assert time.monotonic() - sent >= 2.0
    assert answer.startswith(b"HTTP/1.1 408 ") and b'"code":"read_timeout"' in answer


def test_clients_closing_right_after_an_answer_are_counted_as_client_closed(short):
    """A close right after an answer is the client's (the scrapes go over one kept-alive connection, counted by neither)."""
    count = 20
    with requests.Session() as scrapes:
        before = {reason: closes(short, reason, scrapes) for reason in ("client_closed", "served")}
        for _ in range(count):
            with connect(short) as sock:
                ask_healthz(sock)
        assert wait_until(lambda: closes(short, "client_closed", scrapes) >= before["client_closed"] + count,
                          WAIT_S, 0.1)
        assert closes(short, "served", scrapes) == before["served"]


def test_pipelined_requests_are_answered_in_order(short):
    with connect(short) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n"
                     b"GET /nowhere HTTP/1.1\r\nHost: t\r\n\r\n"
                     b"GET /readyz HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        answers = eof_at(sock)
    assert re.findall(rb"HTTP/1\.1 (\d+)", answers) == [b"200", b"404", b"200"]


def test_large_heads_within_gunicorn_s_limits_are_served_and_larger_ones_refused(short):
    fields = "".join(f"X-Pad-{i}: {'a' * 7000}\r\n" for i in range(9))  # 63 KiB of header fields
    with connect(short) as sock:
        sock.sendall(f"GET /healthz HTTP/1.1\r\nHost: t\r\n{fields}Connection: close\r\n\r\n".encode())
        assert eof_at(sock).startswith(b"HTTP/1.1 200")
    # Over gunicorn's whole-head bound (100 fields of 8190 bytes), never ending: refused at once.
    with connect(short) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n")
        try:
            for i in range(120):
                sock.sendall(f"X-Pad-{i}: {'a' * 8000}\r\n".encode())
        except OSError:
            pass  # the server closed once it had answered
        answer = eof_at(sock)
    assert re.match(rb"HTTP/1\.1 (400|431) ", answer), answer[:200]
    assert requests.get(short.url + "/healthz", timeout=WAIT_S).status_code == 200


@pytest.fixture(scope="module")
def bounded():
    """One worker, at most 50 connections, header and read timeouts 20 s."""
    with gunicorn_server(workers=1, env={"BLOCKGRAD_MAX_CONNECTIONS": "50", "BLOCKGRAD_HEADER_TIMEOUT_S": "20",
                                         "BLOCKGRAD_READ_TIMEOUT_S": "20"}) as server:
        yield server


def test_past_the_bound_the_longest_idle_connection_is_closed_and_probes_get_in(bounded):
    before = closes(bounded, "evicted")
    idle = []
    try:
        for _ in range(60):
            idle.append(connect(bounded))
            # Accepted before the next connects: the worker's order is the client's.
            assert wait_until(lambda: connection_owner(bounded, idle[-1]) is not None or readable([idle[-1]]),
                              WAIT_S, 0.01), "the worker never accepted a connection"
        assert requests.get(bounded.url + "/healthz", timeout=WAIT_S).status_code == 200
        assert wait_until(lambda: closes(bounded, "evicted") >= before + 10, WAIT_S)
        shut = [i for i, sock in enumerate(idle) if readable([sock])]
        assert all(closed_without_a_word(idle[i]) for i in shut)
        # Each connection past the bound (the probe, the scrapes) evicted the oldest left.
        assert len(shut) >= 10 and shut == list(range(len(shut))), shut
        assert not readable(idle[-10:])  # the newest are still open
        metrics = scrape(bounded)
        assert metrics[("blockgrad_connections_open", ())] <= 51
        assert metrics[("blockgrad_connections_closed_total", (("reason", "evicted"),))] >= before + 10
    finally:
        for sock in idle:
            sock.close()


def test_head_and_body_must_arrive_within_the_read_timeout_of_the_connection(bounded):
    """The read clock starts at accept, not with the head or the body. `early` connects and
    idles; `late` connects 6 s later and sends its head at once; `early` sends its head 6 s after
    that; both then drip their bodies. From accept, `early` gets its 408 read_timeout first (at
    20 s, `late` at 26 s); were the clock to start with the head or the body, `late` would (at 26
    s, `early` at 32 s). A verdict on which is cut first: 6 s apart either way."""
    post = (b"POST /v1/gradients HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n")
    with connect(bounded) as early:
        time.sleep(6)
        with connect(bounded) as late:
            late.sendall(post)
            time.sleep(6)
            early.sendall(post)
            cut_at, answers = {}, {}  # the look at which each was found answered
            for look in range(10 * WAIT_S):  # until the server has answered both (bounded)
                for sock in readable([s for s in (early, late) if s not in cut_at]):
                    cut_at[sock], answers[sock] = look, eof_at(sock)
                if len(cut_at) == 2:
                    break
                for sock in (early, late):
                    if sock not in cut_at and look % 10 == 0:  # a body byte a second each
                        try:
                            sock.send(b" ")
                        except OSError:
                            pass  # closed meanwhile: the next look reads the answer
                time.sleep(0.1)
    assert len(cut_at) == 2, "the server never answered"
    for sock in (early, late):  # a head after the header timeout would have been closed unanswered
        assert answers[sock].startswith(b"HTTP/1.1 408 ") and b'"code":"read_timeout"' in answers[sock], \
            answers[sock][:200]
    assert cut_at[early] < cut_at[late], "the read clock started after accept"


def test_a_read_timeout_below_the_header_timeout_cuts_a_partial_head():
    """Head and body must arrive within BLOCKGRAD_READ_TIMEOUT_S: set below the header timeout,
    it cuts a partial head, and the 408 names it. The socket's 20 s bound is far above the read
    timeout (1 s) and well under the header timeout (30 s): a server that waits for the latter fails."""
    env = {"BLOCKGRAD_READ_TIMEOUT_S": "1", "BLOCKGRAD_HEADER_TIMEOUT_S": "30"}
    with gunicorn_server(workers=1, env=env) as server, connect(server, timeout=20) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n")  # never finished
        try:
            answer = eof_at(sock)
        except TimeoutError:
            pytest.fail("no answer in 20 s: the partial head waits for the header timeout (30 s)")
    head, body = answer.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 408 ") and b"X-Blockgrad-Error-Code: read_timeout" in head, answer[:200]
    error = json.loads(body)["error"]
    assert error["details"] == {"timeout_s": 1.0}
    assert "BLOCKGRAD_READ_TIMEOUT_S = 1 s" in error["message"], error["message"]


def test_the_default_bound_holds_the_flood_the_service_is_sized_for(monkeypatch):
    """Workers x BLOCKGRAD_MAX_CONNECTIONS >= 1500 + 40 x BLOCKGRAD_HEADER_TIMEOUT_S at make
    serve's 2 workers; below it, gunicorn's start-up log says what to raise it to."""
    from app.serving.settings import ServingSettings
    from app.serving.worker import ConnectionWorker

    settings = ServingSettings.from_env({})
    assert 2 * settings.max_connections >= 1500 + 40 * settings.header_timeout_s

    class Cfg:
        is_ssl, http_protocols, workers = False, ("h1",), 1

    class Log:
        lines: list[str] = []

        def warning(self, message, *args):
            self.lines.append(message % args)
    log = Log()
    monkeypatch.delenv("BLOCKGRAD_MAX_CONNECTIONS", raising=False)
    monkeypatch.delenv("BLOCKGRAD_HEADER_TIMEOUT_S", raising=False)
    ConnectionWorker.check_config(Cfg(), log)
    assert log.lines and "raise it to 1900" in log.lines[0]


class Recorded:
    """A stand-in for what the worker calls around one connection: its log, its close and its metrics."""

    def __init__(self):
        self.errors, self.closed, self.reasons = [], [], []
        self.log = self
        self.metrics = self
        self.CLOSED = self

    def error(self, message, *args, exc_info=None):
        self.errors.append((message % args, exc_info))

    def exception(self, message, *args):
        self.errors.append((message % args, None))

    def labels(self, reason):
        self.reasons.append(reason)
        return self

    def inc(self):
        pass


def bare_worker(recorded: Recorded):
    from app.serving.worker import ConnectionWorker

    worker = object.__new__(ConnectionWorker)  # no loop: only the two methods below run
    worker.log, worker.metrics = recorded.log, recorded.metrics
    worker.close_after_answer = lambda conn, reason="served": recorded.closed.append((conn, reason))
    return worker


def test_a_request_whose_pool_thread_raised_is_logged_when_its_connection_closes():
    from concurrent.futures import Future

    recorded, conn, failed = Recorded(), object(), Future()
    error = RuntimeError("escaped gthread's handle()")
    failed.set_exception(error)
    bare_worker(recorded).finish_request(conn, failed)
    assert recorded.closed == [(conn, "served")]
    assert [exc_info for _, exc_info in recorded.errors] == [error]


def test_a_connection_closed_because_no_thread_could_start_is_not_counted_served():
    class NoThreads:
        def submit(self, *args):
            raise RuntimeError("can't start new thread")

    recorded, conn = Recorded(), object()
    worker = bare_worker(recorded)
    worker.tpool = NoThreads()
    worker.enqueue_req(conn)
    assert recorded.closed == [(conn, "no_thread")]
