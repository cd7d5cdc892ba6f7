"""Cheap hostile clients against the service's own edge, and what they do to small requests.

The clients (each bounded in count and time, loopback only):
- `IdleFlood`: connections that send nothing, many at once, then more every second;
- `HeaderDrip`: connections sending a request head one byte a second (header slowloris),
  each recording when and how the server closed it;
- `Prober`: a small request on a fresh connection every interval, alternating `/healthz`
  and the README's 10 x 5 `/v1/gradients`, recording each one's latency.

The rows (`idle_flood_row`, `slowloris_row`: `row(bench) -> list[Result]`, as bench/rows.py's)
measure the probes' p99 under each attack against the same probes without it, on a server
started as `make serve` runs it. tests/test_connections.py uses the same clients.
"""
import http.client
import resource
import select
import socket
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from tools.server import gunicorn_server

from .measure import Result, at_least, ms

CONNECT_TIMEOUT_S = 30
# A request head that never ends within any header timeout at a byte a second.
DRIP_HEAD = b"GET /healthz HTTP/1.1\r\nHost: attacker\r\nX-Padding: " + b"a" * 4000 + b"\r\n\r\n"


def raise_open_files(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed if hard == resource.RLIM_INFINITY else min(needed, hard),
                                                    hard))


def connect(port: int) -> socket.socket | None:
    try:
        return socket.create_connection(("127.0.0.1", port), timeout=CONNECT_TIMEOUT_S)
    except OSError:
        return None


class IdleFlood:
    """`initial` idle connections opened at once, then `per_second` more each second for
    `seconds` (a thread); all closed on exit. `opened` counts what connected."""

    def __init__(self, port: int, initial: int, per_second: int, seconds: float):
        self.port, self.initial, self.per_second, self.seconds = port, initial, per_second, seconds
        self.sockets: list[socket.socket] = []
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._grow, daemon=True)

    @property
    def opened(self) -> int:
        return len(self.sockets)

    def _open(self, count: int) -> None:
        for _ in range(count):
            sock = connect(self.port)
            if sock is None:
                self.failed += 1
            else:
                self.sockets.append(sock)

    def _grow(self) -> None:
        end = time.monotonic() + self.seconds
        while not self._stop.is_set() and time.monotonic() < end:
            tick = time.monotonic()
            self._open(self.per_second)
            self._stop.wait(max(0.0, 1.0 - (time.monotonic() - tick)))

    def __enter__(self) -> "IdleFlood":
        raise_open_files(self.initial + self.per_second * int(self.seconds + 2) + 512)
        self._open(self.initial)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(self.seconds + CONNECT_TIMEOUT_S)
        for sock in self.sockets:
            sock.close()


@dataclass
class Dripper:
    sock: socket.socket
    opened_at: float
    sent: int = 0
    closed_at: float | None = None
    received: bytes = b""


@dataclass
class HeaderDrip:
    """`count` connections each sending DRIP_HEAD one byte a second for `seconds` (a thread).
    A connection the server closes is recorded (when, and what it sent before closing) and,
    with `reconnect`, replaced by a new one, so that `count` stay attacking."""
    port: int
    count: int
    seconds: float
    reconnect: bool = False
    drippers: list[Dripper] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _new(self) -> None:
        opened_at = time.monotonic()  # before connecting: the server's clock starts later
        sock = connect(self.port)
        if sock is not None:
            sock.setblocking(False)
            self.drippers.append(Dripper(sock, opened_at))

    def live(self) -> list[Dripper]:
        return [d for d in self.drippers if d.closed_at is None]

    def _read(self, dripper: Dripper, now: float) -> None:
        try:
            data = dripper.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        dripper.received += data
        if not data:
            dripper.closed_at = now
            dripper.sock.close()

    def _run(self) -> None:
        end = time.monotonic() + self.seconds
        while not self._stop.is_set() and time.monotonic() < end:
            tick = time.monotonic()
            live = self.live()
            poller = select.poll()
            by_fd = {}
            for dripper in live:
                poller.register(dripper.sock.fileno(), select.POLLIN)
                by_fd[dripper.sock.fileno()] = dripper
            for fd, _ in poller.poll(0):
                self._read(by_fd[fd], time.monotonic())
            for dripper in self.live():
                try:
                    dripper.sock.send(DRIP_HEAD[dripper.sent % len(DRIP_HEAD):][:1])
                    dripper.sent += 1
                except BlockingIOError:
                    pass
                except OSError:
                    self._read(dripper, time.monotonic())
            if self.reconnect:
                for _ in range(self.count - len(self.live())):
                    self._new()
            # Closes between the bytes are seen at most 0.1 s late.
            while time.monotonic() - tick < 1.0 and not self._stop.is_set():
                live = self.live()
                poller = select.poll()
                by_fd = {d.sock.fileno(): d for d in live}
                for fd in by_fd:
                    poller.register(fd, select.POLLIN)
                for fd, _ in poller.poll(100):
                    self._read(by_fd[fd], time.monotonic())

    def __enter__(self) -> "HeaderDrip":
        raise_open_files(4 * self.count + 512)
        for _ in range(self.count):
            self._new()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join(self.seconds + 10)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self.join()
        for dripper in self.live():
            dripper.sock.close()


def probe_once(port: int, method: str, path: str, body: bytes | None, timeout_s: float) -> float | None:
    """Seconds from connecting to the whole 200 answer on a fresh connection, or None."""
    start = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        response.read()
        return time.monotonic() - start if response.status == 200 else None
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


@dataclass
class Prober:
    """Every `interval_s`, `/healthz` then the 10 x 5 request (`body`), each on a fresh
    connection, for `seconds` (a thread). `latencies[path]`: seconds per probe, None when it
    failed or took over `timeout_s`."""
    port: int
    body: bytes
    seconds: float
    interval_s: float = 0.25
    timeout_s: float = 5.0
    latencies: dict[str, list[float | None]] = field(default_factory=lambda: {"/healthz": [], "/v1/gradients": []})
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _run(self) -> None:
        end = time.monotonic() + self.seconds
        turn = 0
        while not self._stop.is_set() and time.monotonic() < end:
            tick = time.monotonic()
            if turn % 2 == 0:
                self.latencies["/healthz"].append(probe_once(self.port, "GET", "/healthz", None, self.timeout_s))
            else:
                self.latencies["/v1/gradients"].append(
                    probe_once(self.port, "POST", "/v1/gradients", self.body, self.timeout_s))
            turn += 1
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - tick)))

    def __enter__(self) -> "Prober":
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join(self.seconds + 2 * self.timeout_s + 5)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self.join()

    def all(self) -> list[float | None]:
        return [x for values in self.latencies.values() for x in values]

    def within(self, seconds: float) -> float:
        """The share of probes answered 200 within `seconds`."""
        probes = self.all()
        return sum(1 for x in probes if x is not None and x <= seconds) / max(1, len(probes))

    def p99(self) -> float:
        """p99 latency, a failed probe counted as its timeout."""
        probes = [self.timeout_s if x is None else x for x in self.all()]
        return float(np.percentile(probes, 99)) if probes else float("nan")


def seed_body() -> bytes:
    from . import workloads

    return workloads.body(workloads.SEED_EXAMPLE)


def probed(port: int, body: bytes, seconds: float) -> Prober:
    with Prober(port, body, seconds) as prober:
        prober.join()
    return prober


def attack_result(name: str, baseline: Prober, attacked: Prober, what: str) -> Result:
    share = attacked.within(1.0)
    return Result(name, ">= 99% within 1 s", f"{100 * share:.1f}% within 1 s", at_least(share, 0.99),
                  f"p99 {ms(attacked.p99())} under {what} vs {ms(baseline.p99())} without "
                  f"({len(attacked.all())} vs {len(baseline.all())} probes, /healthz and 10 x 5 alternating "
                  f"every {attacked.interval_s * 1e3:.0f} ms, fresh connections)")


def idle_flood_row(bench=None, seconds: float = 60.0, initial: int = 1500, per_second: int = 40) -> list[Result]:
    """`initial` idle connections at once, then `per_second` more each second for `seconds`."""
    body = seed_body()
    with gunicorn_server(workers=None, device=None, ready_path="/readyz") as server:
        baseline = probed(server.port, body, min(seconds, 15.0))
        with IdleFlood(server.port, initial, per_second, seconds) as flood:
            attacked = probed(server.port, body, seconds)
            opened = flood.opened
    return [attack_result(f"19. small requests under an idle flood ({initial} + {per_second}/s)", baseline,
                          attacked, f"{opened} idle connections opened")]


def slowloris_row(bench=None, seconds: float = 60.0, count: int = 200) -> list[Result]:
    """`count` connections sending headers one byte a second, each replaced when closed."""
    body = seed_body()
    with gunicorn_server(workers=None, device=None, ready_path="/readyz") as server:
        baseline = probed(server.port, body, min(seconds, 15.0))
        with HeaderDrip(server.port, count, seconds, reconnect=True) as drip:
            attacked = probed(server.port, body, seconds)
            closed = sum(d.closed_at is not None for d in drip.drippers)
    return [attack_result(f"19. small requests under header slowloris ({count} at 1 byte/s)", baseline, attacked,
                          f"{count} dripping heads ({closed} closed by the server and replaced)")]
