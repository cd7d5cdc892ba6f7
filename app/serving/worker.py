"""The gunicorn worker class: gthread, with connections waiting in its poller until their head is complete.

gunicorn's gthread worker hands each new connection to a pool thread, which waits for its first
byte and then reads the head at the client's pace: idle connections and clients that send their
headers a byte at a time hold the threads that probes need. Here the main loop does all the
waiting. It reads each request head without blocking into the connection's buffer; only a
connection with a complete head goes to gthread's thread pool, where gunicorn's own parser reads
the buffered bytes (put back in front of the socket, in its unreader) and serves the request as
gthread does: keep-alive, pipelining, max_requests, graceful shutdown and the heartbeat are
gthread's code. An answered kept-alive connection comes back to the poller.

A connection's clock starts at accept, or at a kept-alive connection's first new byte: the head
must arrive within BLOCKGRAD_HEADER_TIMEOUT_S (nothing sent: closed without a word; a partial
head: 408 read_timeout), head and body within BLOCKGRAD_READ_TIMEOUT_S (the app's read alarm
counts from environ[host.CONN_STARTED_KEY]). At most worker_connections (BLOCKGRAD_MAX_CONNECTIONS)
are open per worker; past it the connection that has waited longest without a complete head is
closed, so that a new one (a probe) always gets in. docs/connections.md has the whole picture;
docs/serving.md lists the gunicorn internals used here.

The master loads this module: it imports neither torch, Flask nor prometheus_client (the
metrics are imported after fork, once PROMETHEUS_MULTIPROC_DIR is set).
"""
import errno
import heapq
import itertools
import json
import math
import re
import resource
import selectors
import socket
import threading
import time
from collections import OrderedDict
from contextlib import suppress
from functools import partial

from gunicorn.http.errors import LimitRequestHeaders
from gunicorn.http.message import DEFAULT_MAX_HEADERFIELD_SIZE, MAX_HEADERS, MAX_REQUEST_LINE
from gunicorn.workers import gthread

from app.core import host
from app.core.settings import Settings
from app.serving.settings import ServingSettings

RECV_BYTES = 64 * 1024
HEAD_END = b"\r\n\r\n"
BARE_LF = re.compile(rb"(?<!\r)\n")  # gunicorn's parser refuses it at once: no need to wait for HEAD_END
# Bytes of request heads one worker holds at most, all waiting connections together: past it
# the longest-idle one is closed (a head may be ~800 KiB under gunicorn's default limits).
HEAD_BYTES_BUDGET = 64 * 1024 * 1024
# A connection being closed after its answer: FIN sent, what the peer still sends is read
# and dropped for this long (at most CLOSE_DRAIN_BYTES), so that the kernel sends no RST that
# could cut the answer short (gunicorn's close_graceful, without blocking the loop).
CLOSE_LINGER_S = 2.0
CLOSE_DRAIN_BYTES = 64 * 1024
POLL_S = 1.0  # the longest the loop sleeps: the heartbeat is looked at this often
NOTIFY_S = 1.0  # the heartbeat's touches at most this often (gunicorn's timeout is >= 120 s)
# How long a waiting connection is left to a sibling before this worker looks again: a
# sibling's state changes wake nothing here.
BALANCE_POLL_S = 0.02
SPARE_FILES = 512  # descriptors beyond the connections: the pool's files, metrics, the app's own

# What a connection is doing. Every state but BUSY waits in the poller (self.waiting).
NEW = "new"  # accepted, no byte yet
HEAD = "head"  # part of a head has arrived
IDLE = "idle"  # kept alive after an answer, no byte of the next request yet
BUSY = "busy"  # a complete head, in the thread pool
CLOSING = "closing"  # answer sent, write side shut, waiting for the peer's FIN

# Why a connection was closed (label of blockgrad_connections_closed_total).
SERVED = "served"  # after its last answer (Connection: close, an error, the client left mid-request)
NO_REQUEST = "no_request"  # sent nothing within the header timeout (closed silently)
HEAD_TIMEOUT = "head_timeout"  # a partial head at the header timeout (408)
HEAD_TOO_LARGE = "head_too_large"  # a head over gunicorn's limits (gunicorn's own error answer)
KEEPALIVE_TIMEOUT = "keepalive_timeout"  # idle past BLOCKGRAD_KEEPALIVE_S (gunicorn's keepalive)
EVICTED = "evicted"  # the longest-idle one without a head, past BLOCKGRAD_MAX_CONNECTIONS
CLIENT_CLOSED = "client_closed"  # the client closed or reset it while it waited in the poller
SHUTDOWN = "shutdown"  # still open when the worker stopped
NO_THREAD = "no_thread"  # closed unanswered: no pool thread could start for its request
EXPIRED = {NEW: NO_REQUEST, IDLE: KEEPALIVE_TIMEOUT}  # why a connection waiting in this state is closed at its deadline


def head_timeout_answer(variable: str, seconds: float) -> bytes:
    """408 read_timeout as the app's error table writes it (app/http/errors.py), made here
    because no app runs before a head is complete; `variable` names the timeout that applied."""
    message = (f"The request head did not arrive within {variable} = {seconds:g} s; "
               "send it faster, or through a proxy that buffers it.")
    body = json.dumps({"error": {"code": "read_timeout", "message": message, "details": {"timeout_s": seconds}}},
                      separators=(",", ":")).encode()
    head = ("HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nX-Blockgrad-Error-Code: read_timeout\r\nConnection: close\r\n\r\n")
    return head.encode("latin-1") + body


class Conn(gthread.TConn):
    """gthread's connection, with the head read so far and the state of its wait."""

    def __init__(self, cfg, sock, client, server, now: float):
        super().__init__(cfg, sock, client, server)  # non-blocking from here
        self.head = bytearray()
        self.started: float | None = now  # None while kept alive without a new byte
        self.state = NEW
        self.version = 0  # bumped on every change of state: older deadlines no longer apply
        self.drained = 0
        self.closed = False


class ConnectionWorker(gthread.ThreadWorker):
    """gunicorn worker class `app.serving.worker.ConnectionWorker` (gunicorn.conf.py)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # The read timeout bounds head and body together, from the same instant: it caps the head's.
        self.header_timeout_s, variable = min(
            (ServingSettings.from_env().header_timeout_s, "BLOCKGRAD_HEADER_TIMEOUT_S"),
            (Settings.from_env().read_timeout_s, "BLOCKGRAD_READ_TIMEOUT_S"))
        self.head_timeout_answer = head_timeout_answer(variable, self.header_timeout_s)
        cfg = self.cfg
        self.max_connections = cfg.worker_connections  # BLOCKGRAD_MAX_CONNECTIONS (gunicorn.conf.py)
        # gthread answers "Connection: close" once this many are kept alive; here the bound
        # closes the longest-idle instead, so that keep-alive never stops for a flood.
        self.max_keepalived = self.max_connections + 1
        # The request line and the whole head, in bytes, as gunicorn's parser bounds them.
        line = cfg.limit_request_line if 0 < cfg.limit_request_line < MAX_REQUEST_LINE else MAX_REQUEST_LINE
        fields = cfg.limit_request_fields if 0 < cfg.limit_request_fields <= MAX_HEADERS else MAX_HEADERS
        size = cfg.limit_request_field_size if cfg.limit_request_field_size > 0 else DEFAULT_MAX_HEADERFIELD_SIZE
        self.line_limit, self.head_limit = line, line + 2 + fields * (size + 2) + 4
        self.waiting: OrderedDict[Conn, None] = OrderedDict()  # least recently active first
        self.deadlines: list[tuple[float, int, Conn, int]] = []  # heap: (due, order, conn, version)
        self.order = itertools.count()
        self.counts = dict.fromkeys((NEW, HEAD, IDLE, BUSY, CLOSING), 0)
        self.head_bytes = 0
        self.clock = threading.local()  # the pool thread's request: its clock's start
        self.metrics = None  # connection_metrics, from init_process on
        self.shown: tuple = (None, None, None)  # the connection gauges' values as last set
        self.published: tuple = (None, None)  # (serving, connections) as the pod last heard them
        self.notified = float("-inf")  # the heartbeat's last touch
        self.deferred_until = float("-inf")  # leaving new connections to a sibling until then

    @classmethod
    def check_config(cls, cfg, log):
        if cfg.is_ssl or "h2" in getattr(cfg, "http_protocols", ()):
            raise RuntimeError("app.serving.worker.ConnectionWorker reads plain HTTP/1.1 heads itself: "
                               "TLS and HTTP/2 need gunicorn's gthread worker")
        settings = ServingSettings.from_env()
        # The flood the service is sized for: 1500 idle connections at once, plus 40 new ones a
        # second, each kept until the header timeout closes it.
        needed = math.ceil(1500 + 40 * settings.header_timeout_s)
        if cfg.workers * settings.max_connections < needed:
            log.warning("%d workers x BLOCKGRAD_MAX_CONNECTIONS = %d hold fewer than the %d connections of the "
                        "flood the service is sized for (docs/connections.md): raise it to %d",
                        cfg.workers, settings.max_connections, needed, math.ceil(needed / cfg.workers))

    def publish_state(self) -> None:
        pod = host.slots
        if pod is None:
            return
        # Serving: a connection accepted and not yet answered (idle and closing ones do not count).
        now = (self.counts[NEW] + self.counts[HEAD] + self.counts[BUSY] > 0, self.nr_conns - self.counts[CLOSING])
        for mark, value, before in zip((pod.mark_serving, pod.mark_connections), now, self.published):
            if value != before:  # marks are flocks: only what the pod does not know yet
                mark(value)
        self.published = now

    def init_process(self):
        from . import connection_metrics  # after fork: PROMETHEUS_MULTIPROC_DIR is set

        self.metrics = connection_metrics
        # The soft RLIMIT_NOFILE raised towards what is needed (up to the hard limit).
        needed = self.max_connections + self.cfg.threads + SPARE_FILES
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < needed:
            target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
            with suppress(ValueError, OSError):
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                soft = target
        if soft < needed:
            self.log.warning("RLIMIT_NOFILE is below %d: BLOCKGRAD_MAX_CONNECTIONS = %d may not all open",
                             needed, self.max_connections)
        super().init_process()

    def load_wsgi(self):
        super().load_wsgi()
        app, clock = self.wsgi, self.clock

        def timed_app(environ, start_response):
            environ[host.CONN_STARTED_KEY] = getattr(clock, "started", None)  # None: no clock (body.py reads it so)
            return app(environ, start_response)
        self.wsgi = timed_app

    # -- the pool thread ------------------------------------------------------------------

    def enqueue_req(self, conn):
        """gthread's, closing the connection when no thread can start."""
        try:
            future = self.tpool.submit(self.handle, conn)
        except RuntimeError:  # threading's "can't start new thread", or the pool shut down
            self.log.exception("no pool thread for a request: its connection is closed")
            self.close_after_answer(conn, NO_THREAD)
            return
        future.add_done_callback(lambda done: self.method_queue.defer(self.finish_request, conn, done))

    def handle(self, conn):
        """gthread's handle(), with the head this loop read put back in front of the socket
        (there always is one: only a complete head is handed over)."""
        # The parser (once per connection) and a blocking socket; an initialised connection is
        # one gthread's handle() does not wait on for a first byte.
        conn.init()
        conn.parser.unreader.unread(bytes(conn.head))
        conn.head = bytearray()
        self.clock.started = conn.started
        return super().handle(conn)

    # -- the main loop --------------------------------------------------------------------

    def run(self):
        self.poller.register(self.method_queue.fileno(), selectors.EVENT_READ, self.method_queue.run_callbacks)
        if host.slots is not None:
            host.slots.mark_ready(True)  # booted: siblings may leave connections to this worker
        while self.alive:
            self.turn(accept=True)
            if not self.is_parent_alive():
                break
        self.stop()

    def turn(self, accept: bool) -> None:
        now = time.monotonic()
        if now - self.notified >= NOTIFY_S:  # the loop turns per event: one heartbeat a second is plenty
            self.notified = now
            self.notify()
        self.publish_state()
        if accept:  # a connection left to a sibling: the listener is looked at again once that is over
            self.set_accept_enabled(now >= self.deferred_until
                                    and (self.nr_conns < self.max_connections or bool(self.waiting)))
        now = time.monotonic()
        deferred = self.deferred_until if self.deferred_until > now else math.inf
        self.wait_for_and_dispatch_events(timeout=max(0.0, min(
            now + POLL_S, self.deadlines[0][0] if self.deadlines else math.inf, deferred) - now))
        self.expire(time.monotonic())
        self.show_metrics()

    def stop(self):
        """Graceful shutdown: no new connections; connections without a byte of a request get
        gthread's short linger (a request arriving meanwhile is answered with Connection:
        close), the rest finish within graceful_timeout."""
        if host.slots is not None:
            host.slots.mark_ready(False)  # first: a worker seen not polling its listener is surely not ready
        self.set_accept_enabled(False)
        # The master closed its copy first: with every worker's closed, a new connect is
        # refused at once (clients and balancers go elsewhere) instead of waiting in the backlog.
        for listener in self.sockets:
            listener.close()
        now = time.monotonic()
        linger = now + gthread.STOP_KEEPALIVE_LINGER
        for conn in list(self.waiting):
            if conn.state in (NEW, IDLE):
                self.wait(conn, conn.state, linger)
        end = now + self.cfg.graceful_timeout
        while self.nr_conns > 0 and time.monotonic() < end:
            self.turn(accept=False)
        for conn in list(self.waiting):
            self.close(conn, SHUTDOWN)
        self.show_metrics()
        self.tpool.shutdown(wait=False)
        self.poller.close()
        self.method_queue.close()

    def accept(self, listener):
        # A new connection waits: left to a ready sibling ranking before this worker by (serving,
        # connections held, slots held) (app/serving/slots.py), so that concurrent fresh
        # connections land on different workers instead of whichever wins the accept race
        # (docs/cores.md); this worker stops polling the listener for a while.
        pod = host.slots
        if pod is not None and self.cfg.workers > 1:
            self.publish_state()
            if pod.sibling_should_take():
                self.deferred_until = time.monotonic() + BALANCE_POLL_S
                self.set_accept_enabled(False)
                return
        try:
            sock, client = listener.accept()
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE):  # out of descriptors: free one, the next accept takes it
                oldest = next(iter(self.waiting), None)
                if oldest is not None:
                    self.close(oldest, EVICTED)  # not counted if it was closing
            elif e.errno not in (errno.EAGAIN, errno.ECONNABORTED, errno.EWOULDBLOCK):
                raise
            return
        now = time.monotonic()
        self.nr_conns += 1
        conn = Conn(self.cfg, sock, client, listener.getsockname(), now)
        self.counts[NEW] += 1
        self.poller.register(conn.sock, selectors.EVENT_READ, partial(self.on_readable, conn))
        self.waiting[conn] = None
        self.push_deadline(conn, now + self.header_timeout_s)
        self.make_room(keep=conn)
        self.publish_state()  # at once: a sibling deciding about the next connection reads it

    def wait(self, conn: Conn, state: str, due: float) -> None:
        """`conn` (already in the poller) waits in `state` until `due` at the latest."""
        self.set_state(conn, state)
        self.push_deadline(conn, due)

    def set_state(self, conn: Conn, state: str) -> None:
        self.counts[conn.state] -= 1
        self.counts[state] += 1
        conn.state = state
        conn.version += 1

    def push_deadline(self, conn: Conn, due: float) -> None:
        heapq.heappush(self.deadlines, (due, next(self.order), conn, conn.version))
        if len(self.deadlines) > 4 * len(self.waiting) + 64:  # drop the entries that no longer apply
            self.deadlines = [entry for entry in self.deadlines if entry[3] == entry[2].version and not entry[2].closed]
            heapq.heapify(self.deadlines)

    def on_readable(self, conn: Conn, _sock) -> None:
        if conn.closed or conn.state == BUSY:  # closed or handed over earlier in this batch of events
            return
        try:
            data = conn.sock.recv(RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.close(conn, SERVED if conn.state == CLOSING else CLIENT_CLOSED)
            return
        if conn.state == CLOSING:
            conn.drained += len(data)
            if not data or conn.drained >= CLOSE_DRAIN_BYTES:
                self.close(conn, SERVED)
            return
        if not data:
            self.close(conn, CLIENT_CLOSED)
            return
        if conn.state == IDLE:  # the next request's clock starts with its first byte
            conn.started = time.monotonic()
        if conn.state in (NEW, IDLE):
            self.wait(conn, HEAD, conn.started + self.header_timeout_s)
        self.waiting.move_to_end(conn)
        searched = max(0, len(conn.head) - 3)
        conn.head += data
        self.head_bytes += len(data)
        self.examine(conn, searched)
        self.make_room(keep=conn)

    def examine(self, conn: Conn, searched: int) -> None:
        """Hand `conn` to the pool once its head is ready for gunicorn's parser: complete, or
        refused from these bytes alone (a bare LF; a request line over its limit: the parser
        answers 414); answer it here when it is over the whole head's bound."""
        head, line_end = conn.head, self.line_limit + 2
        if (head.find(HEAD_END, searched) >= 0 or BARE_LF.search(head, searched)
                or (len(head) > line_end and head.find(b"\r\n", 0, line_end) < 0)):
            self.leave_poller(conn)
            self.set_state(conn, BUSY)
            # Before the hand-over: a flock after it would take the GIL back from the pool thread.
            self.publish_state()
            self.enqueue_req(conn)
        elif len(head) > self.head_limit:  # gunicorn's own answer to a head it cannot take, then close
            self.handle_error(None, conn.sock, conn.client, LimitRequestHeaders("max buffer headers"))
            self.close_after_answer(conn, HEAD_TOO_LARGE)

    def leave_poller(self, conn: Conn) -> None:
        if self.waiting.pop(conn, False) is None:
            self.head_bytes -= len(conn.head)
            with suppress(KeyError, ValueError, OSError):
                self.poller.unregister(conn.sock)

    def finish_request(self, conn, done):
        """A pool thread is done with `conn` (on the main loop): kept alive when gthread's handle() returned True."""
        error = None if done.cancelled() else done.exception()
        if error is not None:  # gthread's handle() logs what it catches; this escaped it
            self.log.error("serving a request: its connection is closed", exc_info=error)
        if done.cancelled() or error is not None or done.result() is not True or conn.closed:
            self.close_after_answer(conn)
            return
        now = time.monotonic()
        conn.sock.setblocking(False)
        self.poller.register(conn.sock, selectors.EVENT_READ, partial(self.on_readable, conn))
        self.waiting[conn] = None
        # A body drain or a pipelining client may have sent the next request's bytes already:
        # its clock starts with them.
        pending = conn.parser.unreader.take_buffered()
        if pending:
            conn.started = now
            conn.head = bytearray(pending)
            self.head_bytes += len(pending)
            self.wait(conn, HEAD, conn.started + self.header_timeout_s)
            self.examine(conn, 0)
        else:
            conn.started = None
            linger = math.inf if self.alive else gthread.STOP_KEEPALIVE_LINGER  # stopping: gthread's short linger
            self.wait(conn, IDLE, now + min(self.cfg.keepalive, linger))
        self.make_room(keep=conn)

    def close_after_answer(self, conn: Conn, reason: str = SERVED) -> None:
        """FIN now, close when the peer's FIN arrives or after CLOSE_LINGER_S (never blocking); `reason` counted."""
        if conn.closed:
            return
        self.metrics.CLOSED.labels(reason).inc()
        try:
            conn.sock.setblocking(False)
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self.close(conn, None)
            return
        if conn in self.waiting:
            self.head_bytes -= len(conn.head)
        else:
            self.poller.register(conn.sock, selectors.EVENT_READ, partial(self.on_readable, conn))
            self.waiting[conn] = None
        conn.head = bytearray()
        self.wait(conn, CLOSING, time.monotonic() + CLOSE_LINGER_S)

    def close(self, conn: Conn, reason: str | None) -> None:
        """Close `conn` now; `reason` counted (None: counted already)."""
        if conn.closed:
            return
        self.leave_poller(conn)
        self.counts[conn.state] -= 1
        conn.closed = True
        conn.version += 1
        self.nr_conns -= 1
        if reason is not None and conn.state != CLOSING:
            self.metrics.CLOSED.labels(reason).inc()
        gthread.util.close(conn.sock)

    def expire(self, now: float) -> None:
        while self.deadlines and self.deadlines[0][0] <= now:
            _, _, conn, version = heapq.heappop(self.deadlines)
            if version != conn.version or conn.closed:
                continue
            if conn.state == HEAD:
                with suppress(OSError):
                    conn.sock.send(self.head_timeout_answer)
                self.close_after_answer(conn, HEAD_TIMEOUT)
            elif conn.state != BUSY:  # NEW, IDLE or CLOSING (a closing one is counted already)
                self.close(conn, EXPIRED.get(conn.state))

    def make_room(self, keep: Conn | None) -> None:
        """Past the bound, close the longest-idle waiting connection; past the bytes of heads
        held, the one holding most. Never `keep` (the one just accepted or active)."""
        while self.nr_conns > self.max_connections:
            oldest = next(iter(self.waiting), None)
            if oldest is None or oldest is keep:
                break
            self.close(oldest, EVICTED)  # not counted if it was closing
        while self.head_bytes > HEAD_BYTES_BUDGET:  # only under attack: a scan is fine
            largest = max((c for c in self.waiting if c is not keep), key=lambda c: len(c.head), default=None)
            if largest is None or not largest.head:
                break
            self.close(largest, EVICTED)

    def show_metrics(self) -> None:
        shown = (self.nr_conns, self.counts[IDLE], self.counts[NEW] + self.counts[HEAD])
        for gauge, value, before in zip((self.metrics.OPEN, self.metrics.IDLE, self.metrics.AWAITING_HEAD),
                                        shown, self.shown):
            if value != before:  # each set is a write to the worker's value file: only those that changed
                gauge.set(value)
        self.shown = shown
