"""The pod's compute slots under a real gunicorn (2 workers): a worker serving a request (its
`serving` mark) leaves fresh connections to its idle sibling; a request on a fresh connection
while one worker computes lands on the other, and both compute at once; a lone request holds
every slot of the pod; a worker SIGKILLed with two requests in flight loses only its own, and
afterwards two requests still compute in parallel; BLOCKGRAD_SLOTS_PER_REQUEST=1 gives one
slot a request.

Slots are read from /proc/locks (the slot files' flocks and the pids holding them) and
connections from /proc (tests/events.py) at known points: the long request, which would
compute for minutes and is ended by closing its socket, holds a worker while the test looks;
a request whose body lacks its last byte, or which waits for a slot the test holds
(HeldSlots), cannot be answered until the test lets it. Verdicts are counts of slots and
workers, never times.
"""
import glob
import http.client
import json
import os
import signal
import socket

import numpy as np
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from app.core.settings import available_cores
from app.serving.slots import PodSlots
from blockgrad_client import Client
from tests.events import HeldSlots, background, connected_workers, connection_owner, slot_directory
from tests.test_api import GOOD
from tools.server import gunicorn_server, wait_until

pytestmark = pytest.mark.slow

WAIT_S = 120  # bound of every poll and answer; reached only on failure
ROUNDS = 3
SAMPLES = 200
LONG = json.dumps({"vectors": np.zeros((8192, 128)).tolist(), "factor": 64, "outputs": ["accumulated"]}).encode()
# The pair request: N = 2048, D = 64, factor 32, accumulated (small integers: a quick parse).
PAIR = {"vectors": (np.arange(2048 * 64).reshape(2048, 64) % 7 - 3).tolist(), "factor": 32,
        "outputs": ["accumulated"]}


@pytest.fixture(scope="module")
def server():
    if available_cores() < 2:
        pytest.skip("needs two cores")
    # Read timeout: a request held with its body's last byte unsent gets no 408 while the test acts.
    with gunicorn_server(workers=2, env={"BLOCKGRAD_REQUEST_TIMEOUT_S": "300",
                                         "BLOCKGRAD_READ_TIMEOUT_S": "300"}) as server:
        yield server


def slot_keys() -> set[str]:
    """The /proc/locks keys (major:minor:inode) of every pod's slot files on this machine."""
    keys = set()
    for path in glob.glob("/dev/shm/blockgrad-slots-*/slot-*") + glob.glob("/tmp/blockgrad-slots-*/slot-*"):
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue
        keys.add(f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}")
    return keys


def slot_holders(workers: set[int], keys: set[str] | None = None) -> dict[int, int]:
    """Worker pid -> slots it holds, for the pids in `workers`."""
    keys = slot_keys() if keys is None else keys
    held: dict[int, int] = {}
    with open("/proc/locks") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] in keys and int(parts[4]) in workers:
                held[int(parts[4])] = held.get(int(parts[4]), 0) + 1
    return held


def post_long(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S)
    sock.sendall(f"POST /v1/gradients HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(LONG)}\r\n\r\n".encode() + LONG)
    return sock


def one_worker_holds_every_slot(server) -> int | None:
    full = [pid for pid, count in slot_holders(set(server.worker_pids())).items() if count == available_cores()]
    return full[0] if full else None


def computing(server, sock) -> int:
    """The worker that accepted `sock`'s connection, once it holds a slot for it."""
    def owner_computes():
        owner = connection_owner(server, sock)
        return owner if owner is not None and owner in slot_holders(set(server.worker_pids())) else None
    assert wait_until(owner_computes, WAIT_S), slot_holders(set(server.worker_pids()))
    return owner_computes()


def two_long_requests_on_two_workers(server) -> None:
    """A long request; once its worker computes it, a second on a fresh connection: the busy
    worker leaves it to its idle sibling (docs/cores.md, "Balancing connections"), which gets
    a slot at the first one's next chunk boundary. Both compute for minutes, so the two
    workers holding a slot at once is an event that lasts, not a moment to sample."""
    first = post_long(server)
    try:
        one = computing(server, first)
        second = post_long(server)
        try:
            other = computing(server, second)
            assert other != one
            assert set(slot_holders(set(server.worker_pids()))) == {one, other}
        finally:
            second.close()
    finally:
        first.close()
    assert wait_until(lambda: slot_holders(set(server.worker_pids())) == {}, WAIT_S)  # client_closed frees them


def exact(accumulated, n: int) -> bool:
    """`sum`'s accumulated gradient: every entry exactly 2N (each pair's gradient is all ones)."""
    accumulated = np.asarray(accumulated)
    return accumulated.shape == (n, 64) and bool((accumulated == 2 * n).all())


def test_a_worker_serving_a_request_leaves_fresh_connections_to_its_idle_sibling(server):
    """A request whose body lacks its last byte keeps worker A serving, holding no slot and one
    connection. Four fresh connections, one after another, each answered and kept alive: all go
    to B though B then holds more connections, because B is not serving (the first of the
    rank, app/serving/slots.py); were the `serving` marks unread, B holding two to A's one
    would leave the next to A. Each connection waits until the pod's marks say A alone is
    serving (an event read from /proc/locks), so the verdict is a count of owners."""
    pod = PodSlots(slot_directory(server))  # its marks, only read
    # Both booted: the server answers once one worker is up; the other may still be warming up
    # and starting its gRPC server, and a worker not ready yet is never left a connection.
    assert wait_until(lambda: pod.pod_state().ready == set(server.worker_pids()), WAIT_S), pod.pod_state()
    body = json.dumps(GOOD).encode()
    held = socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S)
    kept = []
    try:
        held.sendall(f"POST /v1/gradients HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:-1])
        assert wait_until(lambda: connection_owner(server, held), WAIT_S)
        serving = connection_owner(server, held)
        owners = []
        for _ in range(4):
            assert wait_until(lambda: pod.pod_state().serving == {serving}, WAIT_S), pod.pod_state()
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S)
            kept.append(sock)
            assert wait_until(lambda: connection_owner(server, sock), WAIT_S)
            owners.append(connection_owner(server, sock))
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
            answer = http.client.HTTPResponse(sock)
            answer.begin()
            assert answer.status == 200 and answer.read()
        assert serving not in owners and len(set(owners)) == 1, (serving, owners)
    finally:
        for sock in [held, *kept]:
            sock.close()


def test_concurrent_requests_land_on_different_workers_and_compute_at_once(server):
    """ROUNDS times: two long requests compute on the two workers at once (counted, every
    round). Pairs sent at the same instant, where the accept race decides, are measured by
    `make bench` (bench.cores, concurrent_pairs_balance), not here. A PAIR then answers exact."""
    for _ in range(ROUNDS):
        two_long_requests_on_two_workers(server)
    answer = requests.post(server.url + "/v1/gradients", json=PAIR, timeout=WAIT_S)
    assert answer.status_code == 200 and exact(answer.json()["accumulated"], 2048), answer.text[:500]


def gauges(server) -> dict[str, float]:
    text = requests.get(server.url + "/metrics", timeout=WAIT_S).text
    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name.startswith("blockgrad_compute_slots")}


def test_a_lone_request_takes_every_slot_of_the_pod(server):
    sock = post_long(server)
    try:
        assert wait_until(lambda: one_worker_holds_every_slot(server) is not None, WAIT_S), \
            slot_holders(set(server.worker_pids()))
        # The queue metrics describe the pod: every slot held, whichever worker answers the scrape.
        cores = available_cores()
        assert wait_until(lambda: gauges(server) == {"blockgrad_compute_slots": cores,
                                                     "blockgrad_compute_slots_busy": cores}, WAIT_S), gauges(server)
    finally:
        sock.close()
    assert wait_until(lambda: slot_holders(set(server.worker_pids())) == {}, WAIT_S)  # client_closed frees them


def unanswered(sock: socket.socket) -> bool:
    """No byte of an answer has arrived on `sock` yet."""
    timeout = sock.gettimeout()
    sock.settimeout(0)
    try:
        sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return True
    finally:
        sock.settimeout(timeout)
    return False


def test_a_sigkilled_worker_loses_only_its_request_and_a_pair_still_runs_in_parallel(server):
    """A long request computing on one worker (it outlasts the few steps before the kill), a PAIR request
    accepted by the other and held there, unanswered, by its body's last byte; the first worker
    SIGKILLed: the killed one's connection gives no answer, the other's, once its last byte is
    sent, answers 200 and exact, and after the master forks a replacement two requests again
    compute on both workers at once and a lone one again holds every slot."""
    body = json.dumps(PAIR).encode()
    doomed = post_long(server)
    survivor = socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S)
    try:
        victim = computing(server, doomed)
        survivor.sendall(f"POST /v1/gradients HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:-1])
        assert wait_until(lambda: connection_owner(server, survivor) is not None, WAIT_S), "never accepted"
        assert connection_owner(server, survivor) != victim
        os.kill(victim, signal.SIGKILL)
        try:
            assert doomed.recv(1) == b""  # closed without an answer byte
        except ConnectionResetError:
            pass
        assert unanswered(survivor)  # its worker still waits for the last byte
        survivor.sendall(body[-1:])
        answer = http.client.HTTPResponse(survivor, method="POST")
        answer.begin()
        assert answer.status == 200 and exact(json.loads(answer.read())["accumulated"], 2048)
    finally:
        doomed.close()
        survivor.close()
    assert wait_until(lambda: len(server.worker_pids()) == 2 and victim not in server.worker_pids(), WAIT_S)
    two_long_requests_on_two_workers(server)  # no slot stayed with the dead worker
    sock = post_long(server)
    try:
        assert wait_until(lambda: one_worker_holds_every_slot(server) is not None, WAIT_S)
    finally:
        sock.close()
    assert wait_until(lambda: slot_holders(set(server.worker_pids())) == {}, WAIT_S)


def test_the_client_package_resends_the_killed_workers_request(server):
    """A request that got no answer byte is safe to resend (gradients are pure): the client
    package does, so its call is answered, exact, although the worker holding it (the only
    request in flight, waiting for a slot the test holds, so certainly unanswered) was
    SIGKILLed; the resend is seen waiting on a live worker before the slots are let go."""
    vectors = np.asarray(PAIR["vectors"], dtype=np.float32)
    thread, results = background(lambda: Client(server.url, timeout=WAIT_S).gradients(vectors, factor=32,
                                                                                        outputs=["accumulated"]))
    with HeldSlots(server) as held:
        thread.start()
        assert wait_until(lambda: held.waiting() == 1, WAIT_S), ("the request never waited for a slot", results)
        [victim] = connected_workers(server)
        os.kill(victim, signal.SIGKILL)
        # Reaped, so its flocks are gone: a waiter now is the client's resend.
        assert wait_until(lambda: victim not in server.worker_pids() and held.waiting() == 1, WAIT_S), \
            ("the client never resent", results)
        assert results == []  # nothing can have answered while every slot is held
    thread.join(WAIT_S)
    [result] = results
    assert not isinstance(result, BaseException), result
    assert exact(result.accumulated, 2048)
    assert wait_until(lambda: len(server.worker_pids()) == 2, WAIT_S)  # the master forks a replacement


def test_one_slot_per_request_when_configured():
    if available_cores() < 2:
        pytest.skip("needs two cores")
    with gunicorn_server(workers=1, env={"BLOCKGRAD_SLOTS_PER_REQUEST": "1",
                                         "BLOCKGRAD_REQUEST_TIMEOUT_S": "300"}) as server:
        workers = set(server.worker_pids())
        sock = post_long(server)
        try:
            worker = computing(server, sock)
            samples = [slot_holders(workers) for _ in range(SAMPLES)]  # a count of looks, not a time
        finally:
            sock.close()
        assert all(sample == {worker: 1} for sample in samples), [x for x in samples if x != {worker: 1}][:5]
        assert wait_until(lambda: slot_holders(workers) == {}, WAIT_S)
