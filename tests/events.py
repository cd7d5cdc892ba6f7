"""Events a test can wait for instead of sleeping: a request has reached the app, a worker
holds a connection, a worker has stopped listening, a request waits for a compute slot (the
test holding them all: HeldSlots). Read from the server's /metrics and from /proc (Linux,
loopback IPv4), each wait bounded by tools.server.wait_until."""
import os
import re
import threading
from pathlib import Path

import requests

from app.serving.slots import SLOT_PREFIX, PodSlots

LISTEN, ESTABLISHED = "0A", "01"  # the TCP state column of /proc/net/tcp
HOLD_WAIT_S = 120  # bound on taking the pod's slots; reached only on failure


def background(call) -> tuple[threading.Thread, list]:
    """A daemon thread (not started) that runs `call` once; its answer, or what it raised, lands
    in the list (read by the test's assertions)."""
    results: list = []

    def run():
        try:
            results.append(call())
        except Exception as exc:  # noqa: BLE001 - the test reports it
            results.append(exc)
    return threading.Thread(target=run, daemon=True), results


def in_flight(server) -> float:
    """blockgrad_requests_in_flight, summed over the live workers (a scrape counts itself)."""
    try:
        text = requests.get(server.url + "/metrics", timeout=10).text
    except requests.RequestException:
        return 0.0
    match = re.search(r"^blockgrad_requests_in_flight ([0-9.e+]+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def reached_the_app(server, requests_held: int = 1):
    """A predicate: `requests_held` requests (besides the scrape) are being answered."""
    return lambda: in_flight(server) >= requests_held + 1


def socket_inodes(local_port: int, remote_port: int | None = None, state: str | None = None) -> set[int]:
    """Inodes of the loopback TCP sockets bound to `local_port` (and connected to `remote_port`)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, st, inode = fields[1], fields[2], fields[3], int(fields[9])
        if int(local.split(":")[1], 16) != local_port:
            continue
        if remote_port is not None and int(remote.split(":")[1], 16) != remote_port:
            continue
        if state is not None and st != state:
            continue
        if inode:
            found.add(inode)
    return found


def holders(inodes: set[int], pids) -> set[int]:
    """The processes among `pids` with a file descriptor on one of those sockets."""
    wanted = {f"socket:[{inode}]" for inode in inodes}
    found = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in wanted:
                    found.add(pid)
                    break
            except OSError:
                continue
    return found


def connection_owner(server, client_sock) -> int | None:
    """The worker that accepted `client_sock`'s connection (server side of it), or None yet."""
    inodes = socket_inodes(server.port, remote_port=client_sock.getsockname()[1])
    owners = holders(inodes, server.worker_pids())
    return next(iter(owners)) if len(owners) == 1 else None


def connected_workers(server) -> set[int]:
    """The workers holding an established client connection on the server's port."""
    return holders(socket_inodes(server.port, state=ESTABLISHED), server.worker_pids())


def workers_listening(server, pids) -> set[int]:
    """Those of `pids` that still hold the listening socket: a worker told to stop closes it."""
    return holders(socket_inodes(server.port, state=LISTEN), pids)


def accepting(pid: int, port: int) -> bool:
    """Whether worker `pid` polls its listening socket for new connections now: one leaving a
    connection to its sibling stops for a moment, one told to stop (SIGTERM) for good."""
    listening = {f"socket:[{inode}]" for inode in socket_inodes(port, state=LISTEN)}
    try:
        fds = {int(fd): os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
    except (FileNotFoundError, ProcessLookupError):
        return False
    listeners = {fd for fd, target in fds.items() if target in listening}
    for fd, target in fds.items():
        if target != "anon_inode:[eventpoll]":
            continue
        try:
            info = Path(f"/proc/{pid}/fdinfo/{fd}").read_text()
        except (FileNotFoundError, ProcessLookupError):
            return False
        watched = {int(m) for m in re.findall(r"^tfd:\s*(\d+)", info, re.MULTILINE)}
        if watched & listeners:
            return True
    return False


def in_flight_in(metrics_dir) -> float:
    """blockgrad_requests_in_flight read from the workers' multiprocess files in `metrics_dir`
    (the server's PROMETHEUS_MULTIPROC_DIR): no request needed, so it works while a sync
    worker's one thread is held."""
    from prometheus_client import CollectorRegistry, multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(metrics_dir))
    return registry.get_sample_value("blockgrad_requests_in_flight") or 0.0


def slot_directory(server) -> str:
    """The pod's compute slots (app/serving/slots.py): the directory of the lock files its workers have open."""
    for worker in server.worker_pids():
        for fd in os.listdir(f"/proc/{worker}/fd"):
            try:
                target = os.readlink(f"/proc/{worker}/fd/{fd}")
            except OSError:
                continue
            if os.path.basename(target).startswith(SLOT_PREFIX):
                return os.path.dirname(target)
    raise AssertionError("no worker holds a slot file open")


class HeldSlots:
    """Every compute slot of the pod, taken by this process as a sibling worker computing would
    hold them (an exclusive flock each): the server's requests wait, certainly, until release."""

    def __init__(self, server):
        self.slots = PodSlots(slot_directory(server))
        self.held = []

    def __enter__(self):
        for _ in range(self.slots.count):
            slot = self.slots.acquire(timeout=HOLD_WAIT_S)
            assert slot is not None, "a compute slot stayed busy"
            self.held.append(slot)
        return self

    def __exit__(self, *exc):
        for slot in self.held:
            slot.release()

    def waiting(self) -> int:
        return self.slots.pod_state().waiting_processes


HANG_S = 120  # far above any answer's bound: reached only by a call that hangs


def answered(call):
    """call()'s value, failing the test if it has not returned after HANG_S (a hang)."""
    outcome = []
    thread = threading.Thread(target=lambda: outcome.append(call()), daemon=True)
    thread.start()
    thread.join(HANG_S)
    assert outcome, f"no answer after {HANG_S} s: hung"
    return outcome[0]
