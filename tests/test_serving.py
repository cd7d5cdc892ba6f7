"""The worker model against a real gunicorn (gthread, the project's gunicorn.conf.py):
keep-alive, probes and shedding under full load, disconnect cancellation, slow uploads,
slow readers, HEAD/304 accounting, and recycling under a small max_requests.

No verdict depends on the machine's speed: the long requests would compute for about a
minute and are ended by closing their sockets; "not delayed" is shown by order (a normal
request is answered while the slow clients are still waiting for theirs), with read and
send timeouts far longer than a small request takes. Every wait is bounded.
"""
import http.client
import json
import select
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from app.core.settings import available_cores
from blockgrad_client.infer import binary_infer_request
from tools.server import gunicorn_server, wait_until
from .test_api import GOOD

pytestmark = pytest.mark.slow

QUEUE_DEPTH = 2
READ_TIMEOUT_S = 15  # how long slow uploads hold out: hundreds of times what a small request takes
SEND_TIMEOUT_S = 3
WAIT_S = 60  # bound of every poll below; reached only on failure
# N=8192, D=128 is 17 billion numbers of blocks (tens of seconds on 2 cores, even batched),
# stopped here by closing the socket.
LONG = json.dumps({"vectors": np.zeros((8192, 128)).tolist(), "factor": 64, "outputs": ["accumulated"]}).encode()


@pytest.fixture(scope="module")
def server():
    with gunicorn_server(workers=1, env={
            "BLOCKGRAD_QUEUE_DEPTH": str(QUEUE_DEPTH), "BLOCKGRAD_READ_TIMEOUT_S": str(READ_TIMEOUT_S),
            "BLOCKGRAD_SEND_TIMEOUT_S": str(SEND_TIMEOUT_S), "BLOCKGRAD_REQUEST_TIMEOUT_S": "120",
            # Four LONG requests reserved for every slot of the pod each (docs/cores.md) fit the ledger.
            "BLOCKGRAD_WORKER_MEMORY_BYTES": str(4 * 2 ** 30)}) as server:
        yield server


def scrape(server) -> dict:
    text = requests.get(server.url + "/metrics", timeout=WAIT_S).text
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def metric(server, name, **labels) -> float:
    return scrape(server).get((name, tuple(sorted(labels.items()))), 0.0)


def log_lines(server) -> list[dict]:
    return [json.loads(line) for line in server.log().splitlines() if line.startswith('{"ts"')]


def raw_post(server, path: str, body: bytes, content_type="application/json", headers: dict | None = None,
             rcvbuf: int | None = None) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S)
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: {content_type}\r\n"
                 f"Content-Length: {len(body)}\r\n{extra}\r\n".encode() + body)
    return sock


def read_response(sock: socket.socket) -> http.client.HTTPResponse:
    response = http.client.HTTPResponse(sock)
    response.begin()
    return response


def answered(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


def test_keep_alive_reuses_one_connection(server):
    with requests.Session() as session:
        for _ in range(20):
            response = session.post(server.url + "/v1/gradients", json=GOOD, timeout=WAIT_S)
            assert response.status_code == 200
            assert response.headers.get("Connection", "").lower() != "close"
        pools = session.get_adapter(server.url).poolmanager.pools
        opened = sum(pools[key].num_connections for key in pools.keys())
    assert opened == 1


def test_a_connection_closes_after_its_hundredth_request(server):
    """So that kept-alive connections spread over the workers again after a recycle."""
    with requests.Session() as session:
        closes = [session.get(server.url + "/healthz", timeout=WAIT_S).headers.get("Connection", "").lower() == "close"
                  for _ in range(120)]
    assert [k for k, closed in enumerate(closes, start=1) if closed] == [100]  # then a new connection


def test_full_load_sheds_at_once_and_probes_answer(server):
    """One computing per core of the pod (its compute slots), QUEUE_DEPTH waiting: the next is
    503 overloaded; probes, /metrics and the docs still answer; closing the clients stops their
    computations (client_closed)."""
    shed_before = metric(server, "blockgrad_shed_requests_total")
    closed_before = metric(server, "blockgrad_errors_total", code="client_closed")
    started_before = metric(server, "blockgrad_queue_wait_seconds_count")
    ids = iter(f"{uuid.uuid4().hex}{i:02d}" for i in range(100))  # this test's lines in a shared log
    mine = []

    def post_long():
        mine.append(next(ids))
        return raw_post(server, "/v1/gradients", LONG, headers={"X-Request-ID": mine[-1]})

    computing = [post_long() for _ in range(available_cores())]
    waiting = []
    try:
        # Each request joins the line only once the one before it is where it belongs: those
        # parsing at once would otherwise reach the gate in any order, and one arriving while
        # two wait for the slot a lone request's extra lane is about to give back is shed.
        assert wait_until(lambda: metric(server, "blockgrad_queue_wait_seconds_count")
                          == started_before + len(computing), WAIT_S), "the long requests did not all start"
        for depth in range(1, QUEUE_DEPTH + 1):
            waiting.append(post_long())
            assert wait_until(lambda: metric(server, "blockgrad_queue_depth") == depth, WAIT_S), \
                (depth, metric(server, "blockgrad_queue_depth"))
        for path in ("/healthz", "/readyz", "/v2/health/live", "/v2/health/ready", "/metrics", "/docs"):
            assert requests.get(server.url + path, timeout=WAIT_S).status_code == 200, path
        refused = requests.post(server.url + "/v1/gradients", json=GOOD, timeout=WAIT_S)
        assert refused.status_code == 503 and int(refused.headers["Retry-After"]) >= 1
        assert refused.json()["error"]["code"] == "overloaded"
        assert refused.headers["X-Blockgrad-Error-Code"] == "overloaded"
        body, headers = binary_infer_request(np.ones((3, 2)), {"factor": 1})
        refused = requests.post(server.url + "/v2/models/blockgrad/infer", data=body, headers=headers, timeout=WAIT_S)
        assert refused.status_code == 503 and set(refused.json()) == {"error"}  # the protocol's shape
        assert metric(server, "blockgrad_shed_requests_total") == shed_before + 2
    finally:
        for sock in [*computing, *waiting]:
            sock.close()
    # Computing and queued requests alike stop when their client leaves, freeing the slots.
    assert wait_until(lambda: metric(server, "blockgrad_errors_total", code="client_closed")
                      == closed_before + len(computing) + QUEUE_DEPTH, WAIT_S)
    assert requests.post(server.url + "/v1/gradients", json=GOOD, timeout=WAIT_S).status_code == 200
    def lines_of_mine() -> list[dict]:  # each is written a moment after its client_closed is counted
        return [line for line in log_lines(server) if line.get("request_id") in mine]
    assert wait_until(lambda: len(lines_of_mine()) >= len(mine), WAIT_S), lines_of_mine()
    stopped = lines_of_mine()
    assert [(line["error"], line["status"]) for line in stopped] == [("client_closed", 499)] * len(mine), stopped


def test_a_client_leaving_mid_stream_stops_the_blocks(server):
    # Blocks too large to keep are recomputed as they are written: the slot is held meanwhile.
    body = json.dumps({"vectors": np.ones((512, 16)).tolist(), "factor": 16, "outputs": ["blocks"]}).encode()
    closed_before = metric(server, "blockgrad_errors_total", code="client_closed")
    sock = raw_post(server, "/v1/gradients", body, rcvbuf=64 * 1024)
    response = read_response(sock)
    assert response.status == 200
    response.read(1000)
    response.close()  # the socket's file too: only then is the connection really closed
    sock.close()
    assert wait_until(lambda: metric(server, "blockgrad_errors_total", code="client_closed") == closed_before + 1,
                      WAIT_S)
    assert requests.post(server.url + "/v1/gradients", json=GOOD, timeout=WAIT_S).status_code == 200


def test_slow_uploads_do_not_hold_up_a_normal_request(server):
    """16 uploads at one byte a second: a normal request is answered while none of them has
    been answered yet (held up, it would come after their 408s); each then gets 408
    read_timeout, its READ_TIMEOUT_S being up."""
    slow = []
    stop = threading.Event()
    try:
        for _ in range(16):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S)
            sock.sendall(b"POST /v1/gradients HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n")
            slow.append(sock)

        def drip():
            for _ in range(3 * READ_TIMEOUT_S):  # bounded: one byte a second each
                for sock in slow:
                    try:
                        sock.send(b" ")
                    except OSError:
                        pass
                if stop.wait(1.0):
                    return
        dripper = threading.Thread(target=drip, daemon=True)
        dripper.start()
        response = requests.post(server.url + "/v1/gradients", json=GOOD, timeout=WAIT_S)
        assert response.status_code == 200
        assert not any(answered(sock) for sock in slow), "the normal request waited for the slow uploads"
        for sock in slow:
            refused = read_response(sock)
            assert refused.status == 408
            assert json.loads(refused.read())["error"]["code"] == "read_timeout"
            refused.close()
    finally:
        stop.set()
        for sock in slow:
            sock.close()
    assert sum(line.get("error") == "read_timeout" for line in log_lines(server)) >= 16


def test_slow_readers_are_cut_after_the_send_timeout_steady_ones_are_not(server):
    big, headers = binary_infer_request(np.ones((600, 8)), {"factor": 4}, outputs=["block_gradients"])  # ~46 MB out
    stalled = [raw_post(server, "/v2/models/blockgrad/infer", big, headers["Content-Type"],
                        {"Inference-Header-Content-Length": headers["Inference-Header-Content-Length"]},
                        rcvbuf=64 * 1024) for _ in range(2)]
    responses = []
    try:
        for sock in stalled:
            responses.append(read_response(sock))
            assert responses[-1].status == 200  # then never read
        response = requests.post(server.url + "/v1/gradients", json=GOOD, timeout=WAIT_S)
        assert response.status_code == 200  # the slot went on once their outputs were computed
        assert wait_until(lambda: sum(line.get("error") == "send_timeout" for line in log_lines(server)) >= 2,
                          WAIT_S)
        assert metric(server, "blockgrad_errors_total", code="send_timeout") >= 2
    finally:
        for item in [*responses, *stalled]:
            item.close()
    # A reader that keeps reading, well under a piece per send timeout, gets all of a long answer.
    steady, headers = binary_infer_request(np.ones((250, 8)), {"factor": 2}, outputs=["block_gradients"])  # 8 MB
    sock = raw_post(server, "/v2/models/blockgrad/infer", steady, headers["Content-Type"],
                    {"Inference-Header-Content-Length": headers["Inference-Header-Content-Length"]},
                    rcvbuf=64 * 1024)
    try:
        response = read_response(sock)
        length, received = int(response.getheader("Content-Length")), 0
        for _ in range(length // (256 * 1024) + 2):  # 256 KiB per 0.1 s: a 1 MiB piece in ~0.4 s
            chunk = response.read(256 * 1024)
            if not chunk:
                break
            received += len(chunk)
            time.sleep(0.1)
        assert received == length
        response.close()
    finally:
        sock.close()


def idle(server) -> bool:
    """Nothing in flight but the scrape itself, nothing queued: other tests' requests are over."""
    state = scrape(server)
    return state[("blockgrad_requests_in_flight", ())] == 1 and state[("blockgrad_queue_depth", ())] == 0


def test_head_and_304_are_counted_and_leave_the_gauges(server):
    assert wait_until(lambda: idle(server), WAIT_S), "requests of another test still in flight"
    before = scrape(server)
    assert requests.head(server.url + "/docs", timeout=WAIT_S).status_code == 200
    asset = server.url + "/docs/assets/swagger-ui.css"
    etag = requests.get(asset, timeout=WAIT_S).headers["ETag"]
    assert requests.get(asset, headers={"If-None-Match": etag}, timeout=WAIT_S).status_code == 304
    assert requests.head(asset, timeout=WAIT_S).status_code == 200
    # A HEAD or 304 left in the gauges would keep them up for good: a bounded wait fails then.
    assert wait_until(lambda: idle(server), WAIT_S), "a HEAD or 304 stayed in the gauges"
    after = scrape(server)

    def count(state, route, method, status):
        return state.get(("blockgrad_requests_total", (("method", method), ("route", route), ("status", status))), 0)
    rule = "/docs/assets/<path:filename>"
    assert count(after, "/docs", "HEAD", "200") == count(before, "/docs", "HEAD", "200") + 1
    assert count(after, rule, "GET", "304") == count(before, rule, "GET", "304") + 1
    assert count(after, rule, "HEAD", "200") == count(before, rule, "HEAD", "200") + 1
    logged = [(line["method"], line["status"]) for line in log_lines(server) if line.get("route") == rule]
    assert ("GET", 304) in logged and ("HEAD", 200) in logged


def test_recycling_under_a_small_max_requests_never_drops_a_request():
    """max_requests 100 +- 10 from GUNICORN_CMD_ARGS; four clients keep sending while both
    workers recycle: every request is answered."""
    with gunicorn_server(workers=2, env={"GUNICORN_CMD_ARGS": "--max-requests 100 --max-requests-jitter 10"}) as srv:
        first = set(srv.worker_pids())

        def client(_):
            statuses = []
            with requests.Session() as session:
                for _ in range(90):
                    statuses.append(session.post(srv.url + "/v1/gradients", json=GOOD, timeout=WAIT_S).status_code)
            return statuses
        with ThreadPoolExecutor(4) as pool:
            statuses = [status for batch in pool.map(client, range(4)) for status in batch]
        assert statuses == [200] * 360
        assert wait_until(lambda: len(srv.worker_pids()) == 2, WAIT_S)
        log = srv.log()
        # A recycled worker leaves with os._exit: its request log is flushed first, every line is there.
        assert sum(1 for line in log_lines(srv) if line["route"] == "/v1/gradients") == 360
        assert "Autorestarting worker after current request" in log
        assert set(srv.worker_pids()) != first
