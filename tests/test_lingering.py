"""Lingering connections (app/serving/lingering.py) and the pool thread's loop that serves them
(ConnectionWorker.serve and next_request, app/serving/worker.py), without gunicorn.

Kept-alive connections that send their next heads one after another are served by the one
thread that answered the first, whichever connection sends; one thread at a time polls them;
the main loop's heads come first; a close, part of a head or nothing within linger_s goes back
to the main loop; the main loop takes back a head left waiting at two looks while the thread
serves another; a lingering connection does not make the worker count as serving.

Real socket pairs stand for the connections; the worker object carries only what serve()
reads, its other collaborators fakes that record. Events, not times: every head a test sends
is in the socket before the thread polls it (sent from inside the request before), and every
wait is bounded."""
import io
import logging
import os
import socket
import threading
import time

import pytest

from app.serving.lingering import Lingering
from app.serving.turns import Turns
from gunicorn.config import Config
from gunicorn.workers import gthread

from app.serving.worker import BUSY, HEAD, IDLE, LOOK_S, NEW, POLL_S, ConnectionWorker
from tools.server import wait_until

LONG_S = 60.0  # a linger, hold or look never reached: the test ends it first
WAIT_S = 30.0  # bound of every wait; reached only on failure
GET = b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n"


class Unreader:
    def __init__(self):
        self.buf = io.BytesIO()

    def unread(self, data: bytes) -> None:
        self.buf = io.BytesIO(bytes(data) + self.buf.getvalue())


class Parser:
    def __init__(self):
        self.unreader = Unreader()


class Conn:
    """A connection: the server's end of a socket pair (sock), the client's (client)."""

    def __init__(self, name: str):
        self.name, self.parser = name, Parser()
        self.sock, self.client = socket.socketpair()
        self.head, self.started, self.client_left, self.partial_head_since = bytearray(), None, False, None

    def __repr__(self):
        return self.name

    def close(self):
        self.sock.close()
        self.client.close()


@pytest.fixture
def conns():
    made = []

    def make(*names):
        made.extend(Conn(name) for name in names)
        return made[-len(names):] if len(names) > 1 else made[-1]
    yield make
    for conn in made:
        conn.close()


class Deferred:
    """gthread's method_queue: the calls the main loop would run, recorded."""

    def __init__(self):
        self.calls, self.lock = [], threading.Lock()

    def defer(self, func, *args):
        with self.lock:
            self.calls.append((func.__name__, args))


class Log:
    def __init__(self):
        self.errors = 0

    def exception(self, *args):
        self.errors += 1


class Pool:
    def __init__(self):
        self.backlog = False

    def backlogged(self) -> bool:
        return self.backlog


def worker(handle, linger_s: float = LONG_S, look_s: float = LONG_S) -> ConnectionWorker:
    """A ConnectionWorker with only serve()'s collaborators; `handle(conn)` is each request."""
    w = object.__new__(ConnectionWorker)
    w.alive, w.stopping, w.turns, w.tpool, w.method_queue, w.log = True, False, Turns(LONG_S), Pool(), Deferred(), Log()
    w.lingering = Lingering(linger_s, look_s, limit=8)
    w.line_limit, w.head_limit = 8190, 1 << 20
    w.handle = handle
    return w


def first_request(w: ConnectionWorker, conn) -> None:
    """`conn`'s first head, started by the main loop (submit_ready)."""
    w.turns.add(conn, now=0.0)
    assert w.turns.due(now=0.0) == [conn]


def serving_thread(w: ConnectionWorker, conn) -> threading.Thread:
    thread = threading.Thread(target=w.serve, args=(conn,), daemon=True)
    thread.start()
    return thread


def test_kept_alive_connections_sending_one_after_another_are_served_by_one_thread(conns):
    """Each request's "client" sends the other connection's next head while it runs, as a
    second client does while the first is served: the answering thread serves it next. The
    last request closes its connection and the other client leaves: nothing lingers."""
    a, b = conns("a", "b")
    script = {("a", 1): b, ("b", 1): a, ("a", 2): b}  # after this request, that connection sends
    served, threads = [], set()

    def handle(conn):
        served.append(conn.name)
        threads.add(threading.get_ident())
        sender = script.get((conn.name, served.count(conn.name)))
        if sender is not None:
            sender.client.sendall(GET)
            return True
        a.client.close()
        return False  # answered with Connection: close
    w = worker(handle)
    assert w.lingering.add(b, now=time.monotonic())  # answered before
    first_request(w, a)
    thread = serving_thread(w, a)
    thread.join(WAIT_S)
    assert not thread.is_alive()
    assert served == ["a", "b", "a", "b"] and threads == {thread.ident}
    back = [args for name, args in w.method_queue.calls if name == "finish_request"]
    assert back == [(b, False), (a, True)] and a.client_left
    assert w.turns.running == 0 and len(w.lingering) == 0 and not w.lingering.watched


def test_the_main_loop_s_next_head_comes_before_a_lingering_one(conns):
    a, b, polled = conns("a", "b", "polled")
    served = []

    def handle(conn):
        served.append(conn.name)
        if conn is a:
            b.client.sendall(GET)  # a lingering connection's head ...
            w.turns.add(polled, now=0.0)  # ... and the main loop's, read after it
        return False  # each answered with Connection: close
    w = worker(handle)
    assert w.lingering.add(b, now=time.monotonic())  # answered before
    first_request(w, a)
    serving_thread(w, a).join(WAIT_S)
    assert served == ["a", "polled", "b"] and len(w.lingering) == 0
    back = [args for name, args in w.method_queue.calls if name == "finish_request"]
    assert back == [(a, False), (polled, False), (b, False)]


def test_a_close_and_part_of_a_head_go_back_to_the_main_loop(conns):
    a, gone, partial = conns("a", "gone", "partial")

    def handle(conn):
        gone.client.close()
        partial.client.sendall(b"GET /healthz HTTP/1.1\r\n")
        return False
    w = worker(handle)
    for conn in (gone, partial):
        assert w.lingering.add(conn, now=time.monotonic())
    first_request(w, a)
    serving_thread(w, a).join(WAIT_S)
    calls = w.method_queue.calls
    assert ("finish_request", (gone, True)) in calls and gone.client_left
    assert ("finish_request", (partial, True)) in calls and not partial.client_left
    assert partial.parser.unreader.buf.getvalue() == b"GET /healthz HTTP/1.1\r\n"  # for the poller
    assert partial.partial_head_since is not None  # its header clock started with those bytes


def test_an_answered_connection_added_while_a_thread_polls_wakes_it(conns):
    """The polling thread's poll does not include a connection added since: add wakes it, and
    its next poll (after unwatch and watch again) does."""
    a, c = conns("a", "c")
    lingering = Lingering(LONG_S, LONG_S, limit=8)
    lingering.add(a, now=time.monotonic())
    watched = lingering.watch()
    woken = []
    thread = threading.Thread(target=lambda: woken.append(lingering.wait(watched, time.monotonic())), daemon=True)
    thread.start()
    lingering.add(c, now=time.monotonic())
    thread.join(WAIT_S)
    assert woken == [[]]  # nothing readable: woken by the add
    lingering.unwatch()
    again = lingering.watch()
    assert [conn for conn, _ in again] == [a, c]
    c.client.sendall(GET)
    assert lingering.wait(again, time.monotonic()) == [c]


def test_a_raising_request_goes_back_to_the_main_loop_and_ends_its_turn(conns):
    """Also a connection the thread took from the lingering ones: it answers for each it serves."""
    a, b = conns("a", "b")

    def handle(conn):
        if conn is a:
            b.client.sendall(GET)
            return False
        raise OSError("reset")
    w = worker(handle)
    assert w.lingering.add(b, now=time.monotonic())
    first_request(w, a)
    w.serve(a)
    back = [args for name, args in w.method_queue.calls if name == "finish_request"]
    assert back == [(a, False), (b, None)] and w.log.errors == 1  # b closed by the main loop
    assert w.turns.running == 0 and len(w.lingering) == 0


def test_pipelined_bytes_already_read_mean_no_lingering(conns):
    a = conns("a")
    a.parser.unreader.buf = io.BytesIO(GET)
    w = worker(lambda conn: True)
    first_request(w, a)
    w.serve(a)
    assert w.method_queue.calls == [("finish_request", (a, True))] and len(w.lingering) == 0
    assert a.parser.unreader.buf.getvalue() == GET  # looking did not move the parser's buffer


def test_with_connections_waiting_for_a_thread_none_lingers(conns):
    a = conns("a")
    w = worker(lambda conn: True)
    w.tpool.backlog = True
    first_request(w, a)
    w.serve(a)
    assert w.method_queue.calls == [("finish_request", (a, True))] and len(w.lingering) == 0


def test_a_lingering_connection_is_not_serving(conns):
    w = worker(lambda conn: True)
    w.counts = {NEW: 0, HEAD: 0, IDLE: 0, BUSY: 1}  # the connection below: answered, on the pool's side
    assert w.serving()
    assert w.lingering.add(conns("kept"), now=time.monotonic())
    assert not w.serving()


def test_a_thread_leaving_lingering_connections_alone_wakes_the_main_loop(conns):
    """Taking the main loop's head instead of polling them, or choosing one head and leaving
    the others, with the main loop not looking: it is woken (tend_lingering deferred), so that
    it looks after them; once it looks, nothing is deferred."""
    a, b, polled = conns("a", "b", "polled")
    w = worker(lambda conn: True)
    assert w.lingering.add(a, now=time.monotonic())
    w.turns.add(polled, now=0.0)
    assert w.next_request() is polled
    assert w.method_queue.calls == [("tend_lingering", ())]
    w.turns.finish()
    assert w.lingering.add(b, now=time.monotonic())
    b.client.sendall(GET)
    assert w.next_request() is b  # a left: the main loop not looking yet
    assert w.method_queue.calls == [("tend_lingering", ())] * 2
    w.turns.finish()
    w.lingering.look(time.monotonic())  # the main loop looks from now on
    assert w.lingering.add(b, now=time.monotonic())
    b.client.sendall(GET)
    assert w.next_request() is b and w.method_queue.calls == [("tend_lingering", ())] * 2


def test_while_connections_linger_the_main_loop_sleeps_at_most_look_s(conns):
    w = worker(lambda conn: True)
    w.deferred_until, w.deadlines = None, []
    assert w.poll_timeout() == POLL_S
    assert w.lingering.add(conns("a"), now=time.monotonic())
    w.lingering.look(time.monotonic())
    assert w.poll_timeout() <= LOOK_S


def test_a_backlog_stops_the_polling_thread(conns):
    """Connections waiting for a free thread: the pool wakes the polling thread, which leaves
    (to take the backlog) with the lingering connections left to the main loop."""
    a = conns("a")
    w = worker(lambda conn: True)
    assert w.lingering.add(a, now=time.monotonic())
    found = []
    thread = threading.Thread(target=lambda: found.append(w.next_request()), daemon=True)
    thread.start()
    assert wait_until(lambda: w.lingering.watched, WAIT_S, 0.001)
    w.tpool.backlog = True
    w.lingering.wake()  # what ServingThreads' on_backlog does
    thread.join(WAIT_S)
    assert found == [None] and len(w.lingering) == 1 and not w.lingering.watched
    assert w.method_queue.calls == [("tend_lingering", ())]


def test_the_master_s_worker_object_opens_no_more_files_than_gthread_s():
    """gunicorn makes a worker object in the master for every spawn: a pipe made then would
    stay open there for good (the lingering set's is made after fork)."""
    def opened(cls) -> int:
        before = len(os.listdir("/proc/self/fd"))
        made = cls(0, os.getpid(), [], None, 30, Config(), logging.getLogger("test"))
        try:
            return len(os.listdir("/proc/self/fd")) - before
        finally:
            made.tmp.close()
    assert opened(ConnectionWorker) == opened(gthread.ThreadWorker)


# -- Lingering alone ----------------------------------------------------------------------


def test_at_most_limit_connections_linger(conns):
    lingering = Lingering(LONG_S, LONG_S, limit=2)
    assert [lingering.add(conn, now=0.0) for conn in conns("a", "b", "c")] == [True, True, False]


def test_one_thread_at_a_time_polls_and_a_wake_interrupts_it(conns):
    a = conns("a")
    lingering = Lingering(LONG_S, LONG_S, limit=8)
    assert lingering.watch() is None  # none lingers
    lingering.add(a, now=0.0)
    watched = lingering.watch()
    assert watched == [(a, LONG_S)] and lingering.watch() is None  # another thread polls them
    lingering.wake()
    assert lingering.wait(watched, now=0.0) == []  # woken: nothing readable
    a.client.sendall(GET)
    assert lingering.wait(watched, now=0.0) == [a]
    assert lingering.claim(a) and not lingering.claim(a)  # taken once
    lingering.unwatch()
    assert not lingering.left_alone()  # none left to look after


def test_the_main_loop_takes_back_a_head_seen_waiting_at_two_looks_in_a_row(conns):
    look_s = 0.02
    a, b = conns("a", "b")
    lingering = Lingering(LONG_S, look_s, limit=8)
    lingering.add(a, now=0.0)
    lingering.add(b, now=0.0)
    assert lingering.left_alone()  # no thread polls and the main loop does not look yet
    a.client.sendall(GET)
    assert lingering.look(now=1.0) == ([], [])  # first seen
    assert lingering.looking and not lingering.left_alone()
    assert lingering.look(now=1.0 + look_s / 2) == ([], [])  # not yet waited look_s
    assert lingering.look(now=1.0 + look_s) == ([], [(a, 1.0)])  # taken back, seen since 1.0
    assert not lingering.claim(a) and len(lingering) == 1


def test_a_polled_connection_is_never_taken_back_and_due_ones_go_back(conns):
    a, b = conns("a", "b")
    lingering = Lingering(0.5, 0.02, limit=8)
    lingering.add(a, now=0.0)
    lingering.add(b, now=1.0)
    a.client.sendall(GET)
    watched = lingering.watch()
    assert lingering.look(now=0.1) == ([], []) and lingering.look(now=0.2) == ([], [])  # a thread polls
    lingering.unwatch()
    assert not lingering.left_alone()  # the main loop already looks
    assert lingering.look(now=0.6) == ([a], [])  # past linger_s: back to the poller, head and all
    assert lingering.look(now=9.0, everything=True) == ([b], [])  # the worker stops
    assert watched and len(lingering) == 0 and not lingering.looking


def test_a_head_taken_back_by_the_main_loop_is_examined_as_the_poller_s(conns):
    """take_back: the bytes waiting go to the parser's buffer for finish_request, the header
    clock (and the turn) counted from when the main loop first saw them; a close is the client's."""
    sent, gone = conns("sent", "gone")
    w = worker(lambda conn: True)
    back = []
    w.finish_request = lambda conn, result: back.append((conn, result))
    sent.client.sendall(GET)
    gone.client.close()
    w.take_back(sent, since=5.0)
    w.take_back(gone, since=6.0)
    assert back == [(sent, True), (gone, True)]
    assert sent.parser.unreader.buf.getvalue() == GET and sent.partial_head_since == 5.0 and not sent.client_left
    assert gone.client_left


def test_a_stopping_worker_s_main_loop_takes_every_lingering_connection_back(conns):
    a, b = conns("a", "b")
    w = worker(lambda conn: True)
    back = []
    w.finish_request = lambda conn, result: back.append((conn, result))
    for conn in (a, b):
        assert w.lingering.add(conn, now=time.monotonic())
    w.tend_lingering()
    assert back == []  # kept while the worker runs
    w.alive = False
    w.tend_lingering()
    assert back == [(a, True), (b, True)] and len(w.lingering) == 0
