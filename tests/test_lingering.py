"""The pool thread's loop (ConnectionWorker.serve, app/serving/worker.py) without gunicorn: its
turn ends when a request raises, the main loop's next head handed on while the thread lingers
is run or closed (never lost, never left counted running), and a thread whose hand-off went
to the backlog stops lingering so that it takes the backlog itself, and a connection whose
thread waits for its next head does not make the worker count as serving.

A worker object carries only what serve() reads; every collaborator is a fake that records."""
import io
import socket
import threading

import pytest

from app.serving.turns import Turns
from app.serving.worker import BUSY, HEAD, IDLE, NEW, ConnectionWorker
from tools.server import wait_until

LONG_HOLD_S = 60.0  # never reached: nothing here waits for a hold
WAIT_S = 30.0  # bound of every wait; reached only on failure


class Unreader:
    def __init__(self):
        self.buf = io.BytesIO()


class Parser:
    def __init__(self):
        self.unreader = Unreader()


class FakeConn:
    def __init__(self, name: str):
        self.name, self.parser = name, Parser()


class Deferred:
    """gthread's method_queue: the calls the main loop would run."""

    def __init__(self):
        self.calls = []

    def defer(self, func, *args):
        self.calls.append((func.__name__, args))


class Pool:
    def __init__(self, refuse: bool = False, backlog_after_submit: bool = False):
        self.refuse, self.backlog_after_submit = refuse, backlog_after_submit
        self.submitted, self.backlog = [], False

    def submit(self, conn):
        if self.refuse:
            raise RuntimeError("can't start new thread")
        self.submitted.append(conn)
        self.backlog = self.backlog_after_submit

    def backlogged(self) -> bool:
        return self.backlog


class Log:
    def __init__(self):
        self.errors = 0

    def exception(self, *args):
        self.errors += 1


def worker(handle, pool: Pool, next_heads: list[bool]) -> ConnectionWorker:
    """A ConnectionWorker with only serve()'s collaborators: `handle` per request, `next_heads`
    the successive verdicts of next_head (counted in worker.next_head_calls)."""
    w = object.__new__(ConnectionWorker)
    w.alive, w.turns, w.tpool, w.method_queue, w.log = True, Turns(LONG_HOLD_S, max_lingering=4), pool, Deferred(), Log()
    w.handle = handle
    w.next_head_calls = 0

    def next_head(conn):
        w.next_head_calls += 1
        return next_heads.pop(0)
    w.next_head = next_head
    return w


def running_first(w: ConnectionWorker, conn) -> None:
    """`conn` started by the main loop, as submit_ready does."""
    w.turns.add(conn, now=0.0)
    assert w.turns.due(now=0.0) == [conn]


def test_a_raising_request_ends_its_turn_and_leaves_the_next_to_a_free_thread():
    def handle(conn):
        raise OSError("reset")
    w, first, polled = worker(handle, Pool(), []), FakeConn("first"), FakeConn("polled")
    running_first(w, first)
    w.turns.add(polled, now=0.0)  # waits for first to end
    with pytest.raises(OSError):
        w.serve(first)
    assert w.turns.running == 0 and w.turns.lingering == 0
    assert w.turns.take_next() is polled  # the thread that ends it takes it


def test_a_next_head_whose_thread_cannot_start_is_closed_and_its_turn_ended():
    w, first, polled = worker(lambda conn: True, Pool(refuse=True), [False]), FakeConn("first"), FakeConn("polled")
    running_first(w, first)
    w.turns.add(polled, now=0.0)
    assert w.serve(first) is True  # first itself goes back to the poller, kept alive
    assert w.method_queue.calls == [("finish_request", (polled, None))]  # closed by the main loop
    assert w.log.errors == 1
    assert w.turns.running == 0 and w.turns.lingering == 0


def test_a_thread_whose_hand_off_waits_in_the_backlog_stops_lingering():
    pool = Pool(backlog_after_submit=True)
    w, first, polled = worker(lambda conn: True, pool, [True]), FakeConn("first"), FakeConn("polled")
    running_first(w, first)
    w.turns.add(polled, now=0.0)
    assert w.serve(first) is True
    assert pool.submitted == [polled] and w.next_head_calls == 0
    assert w.turns.lingering == 0 and w.turns.running == 1  # polled, waiting for this thread


def test_a_next_head_handed_on_to_a_free_thread_while_this_one_lingers():
    pool = Pool()
    w, first, polled = worker(lambda conn: True, pool, [False]), FakeConn("first"), FakeConn("polled")
    running_first(w, first)
    w.turns.add(polled, now=0.0)
    assert w.serve(first) is True
    assert pool.submitted == [polled] and w.next_head_calls == 1
    assert w.turns.lingering == 0 and w.turns.running == 1


def test_a_thread_serves_the_next_heads_that_arrive_while_it_lingers():
    served = []
    w, conn = worker(lambda c: served.append(c) or True, Pool(), [True, True, False]), FakeConn("kept")
    running_first(w, conn)
    assert w.serve(conn) is True
    assert served == [conn] * 3 and w.next_head_calls == 3
    assert w.turns.running == 0 and w.turns.lingering == 0


def test_pipelined_bytes_already_read_mean_no_lingering():
    w, conn = worker(lambda c: True, Pool(), []), FakeConn("pipelined")
    conn.parser.unreader.buf = io.BytesIO(b"GET / HTTP/1.1\r\n")
    position = conn.parser.unreader.buf.tell()
    running_first(w, conn)
    assert w.serve(conn) is True and w.next_head_calls == 0
    assert conn.parser.unreader.buf.tell() == position  # looking did not move the parser's buffer


def test_a_thread_waiting_for_its_connection_s_next_head_is_not_serving():
    w = object.__new__(ConnectionWorker)
    w.linger_s, w.line_limit, w.head_limit = WAIT_S, 8190, 1 << 20
    w.awaiting_next_head, w.awaiting_lock = 0, threading.Lock()
    w.counts = {NEW: 0, HEAD: 0, IDLE: 0, BUSY: 1}  # the connection below, answered, in its pool thread
    ours, client = socket.socketpair()
    with ours, client:
        conn = FakeConn("kept")
        conn.sock, conn.head, conn.started = ours, bytearray(), None
        verdicts = []
        thread = threading.Thread(target=lambda: verdicts.append(w.next_head(conn)), daemon=True)
        thread.start()
        assert wait_until(lambda: w.awaiting_next_head == 1, WAIT_S, 0.001)
        assert not w.serving()
        client.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        thread.join(WAIT_S)
    assert verdicts == [True] and w.awaiting_next_head == 0 and w.serving()
