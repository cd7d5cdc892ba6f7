"""A stream whose blocks are recomputed as they are written holds a compute slot only while it
computes a band, never while its answer waits for the reader: in process, counted on the
app's slots (one slot: a second request computes while the first stream is paused mid-way,
and every recomputed band ran on a slot); under gunicorn, a reader that has stopped reading
leaves the pod's slots all free (counted in /proc/locks, never timed).
"""
import http.client
import socket
import threading

import numpy as np
import orjson
import pytest
import requests
import torch

from app import create_app
from app.core import host
from app.core import run as run_module
from app.core.slots import Deadline, Gate, ThreadSlots
from app.core.engine import elements_per_chunk, plan_bands
from app.core.objectives import OBJECTIVES
from app.extensions import services_of
from tools.reference import reference_blocks
from tools.server import gunicorn_server, wait_until

from .numeric import assert_matches
from .test_cores_serving import slot_holders

WAIT_S = 120  # bound of every wait; reached only on failure
N, DIM, FACTOR = 64, 3, 8
# Dense gradients (sum_of_squares) over the keep budget: recomputed band by band as written.
SMALL_KEEP = {"TESTING": True, "BLOCKGRAD_MAX_BLOCK_ELEMENTS": "2000"}


class CountingSlots(ThreadSlots):
    """One process's slots that count how often one was taken."""

    def __init__(self, count: int):
        super().__init__(count)
        self.taken = 0

    def try_acquire(self):
        slot = super().try_acquire()
        self.taken += slot is not None
        return slot

    def acquire(self, timeout=None):
        slot = super().acquire(timeout)
        self.taken += slot is not None
        return slot


@pytest.fixture
def one_slot(monkeypatch):
    """The app built as a gunicorn worker builds it, on a pod of one slot (threads here)."""
    slots = CountingSlots(1)
    monkeypatch.setattr(host, "slots", slots)
    return slots


def document(vectors: np.ndarray, outputs=("blocks",)) -> dict:
    return {"vectors": vectors.tolist(), "factor": FACTOR, "outputs": list(outputs), "dtype": "float64",
            "objective": "sum_of_squares"}


def assert_blocks_are_the_reference(answer: dict, vectors: np.ndarray) -> None:
    seed = reference_blocks(torch.tensor(vectors), FACTOR, "sum_of_squares", 5.0)
    assert [(b["row"], b["col"]) for b in answer["blocks"]] == [(r, c) for r in range(FACTOR) for c in range(FACTOR)]
    for block in answer["blocks"]:
        loss, gradient = seed[block["row"] * FACTOR + block["col"]]
        assert_matches([block["loss"]], [loss.item()], "float64", what=f"block {block['row'], block['col']} loss")
        assert_matches(block["gradient"], gradient, "float64", what=f"block {block['row'], block['col']} gradient")


def test_a_paused_stream_holds_no_slot_and_each_band_computes_on_one(one_slot, monkeypatch):
    app = create_app(SMALL_KEEP)
    gate = services_of(app).gate
    assert gate.source is one_slot
    held_while_computing = []
    real = run_module.chunk_gradients

    def counted(*args, **kwargs):
        held_while_computing.append(one_slot.busy)
        return real(*args, **kwargs)

    monkeypatch.setattr(run_module, "chunk_gradients", counted)  # pass two's chunks (pass one's are the executor's)
    vectors = np.random.default_rng(3).standard_normal((N, DIM))
    response = app.test_client().post("/v1/gradients", json=document(vectors), buffered=False)
    assert response.status_code == 200
    pieces = iter(response.response)
    received = [next(pieces), next(pieces)]  # the head and the first band's blocks at least
    assert held_while_computing, "nothing was recomputed: the blocks were kept"
    assert one_slot.busy == 0  # paused mid-stream: the only slot is free
    taken_before = one_slot.taken

    # Another request computes on that slot while the first stream waits for its reader.
    other = {}

    def second():
        other["response"] = app.test_client().post("/v1/gradients", json=document(vectors, ["accumulated"]))

    thread = threading.Thread(target=second)
    thread.start()
    thread.join(WAIT_S)
    assert "response" in other, "the second request did not finish"
    assert other["response"].status_code == 200
    # sum_of_squares: 2B in each block, and each entry of V in 2N pairs, so 4N V
    assert_matches(other["response"].get_json()["accumulated"], 4 * N * vectors, "float64", what="second request")
    assert one_slot.taken == taken_before + 1

    received.extend(pieces)
    answer = orjson.loads(b"".join(received))
    assert_blocks_are_the_reference(answer, vectors)
    chunk = elements_per_chunk(services_of(app).settings.max_block_elements, OBJECTIVES["sum_of_squares"], DIM, 8)
    bands = len(list(plan_bands(N, DIM, FACTOR, chunk)))
    assert bands > 2, bands
    assert len(held_while_computing) >= bands and set(held_while_computing) == {1}  # every chunk on the slot
    # Pass one's slot, one slot again for every band (the first too: the answer starts
    # after the request's own slot was given back), and the second request's.
    assert one_slot.taken == 1 + bands + 1
    assert one_slot.busy == 0


def test_resuming_goes_next_in_line_and_is_never_refused():
    slots = ThreadSlots(1)
    gate = Gate(queue_depth=2, slots=slots)
    held = gate.acquire(Deadline(WAIT_S))
    order, threads = [], []

    def waits(kind):
        ticket = gate.resume(Deadline(WAIT_S)) if kind == "stream" else gate.acquire(Deadline(WAIT_S))
        order.append(kind)
        ticket.release()

    for depth, kind in enumerate(["first request", "second request", "stream"], start=1):
        threads.append(threading.Thread(target=waits, args=(kind,)))
        threads[-1].start()
        assert wait_until(lambda: gate.depth == depth, WAIT_S, 0.01)  # the stream: not refused for a full line
    held.release()
    for thread in threads:
        thread.join(WAIT_S)
    assert order == ["first request", "stream", "second request"]
    assert slots.busy == 0 and gate.busy == 0


@pytest.mark.slow
def test_a_reader_that_stops_reading_holds_no_slot_of_the_pod():
    """gunicorn, one worker: a stream of recomputed blocks (about 12 MB of JSON) whose client
    reads its head and then nothing leaves every slot of the pod free, counted in /proc/locks;
    another request is served meanwhile; read at last, the stream is whole and exact. The send
    timeout and the deadline are far beyond the test's waits: only giving the slot back
    between bands can free it."""
    env = {"BLOCKGRAD_MAX_BLOCK_ELEMENTS": "65536", "BLOCKGRAD_SEND_TIMEOUT_S": "900",
           "BLOCKGRAD_REQUEST_TIMEOUT_S": "900"}
    n, dim, factor = 256, 8, 8
    vectors = np.random.default_rng(4).standard_normal((n, dim)).astype(np.float32)
    body = orjson.dumps({"vectors": vectors.tolist(), "factor": factor, "outputs": ["blocks"],
                         "objective": "sum_of_squares"})
    with gunicorn_server(workers=1, env=env) as server:
        workers = set(server.worker_pids())
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S)
        # A small window, but above loopback's MSS (64 KiB): below it, the sender waits on
        # zero-window probes, whose backoff makes the final read take minutes.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 256 * 1024)
        sock.sendall(f"POST /v1/gradients HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        try:
            response = http.client.HTTPResponse(sock)
            response.begin()
            assert response.status == 200
            first = response.read(1024)  # then nothing, for now
            assert wait_until(lambda: not slot_holders(workers), WAIT_S, 0.01), \
                "the stalled stream still holds a slot"
            other = requests.post(server.url + "/v1/gradients", timeout=WAIT_S,
                                  json={"vectors": vectors.tolist(), "factor": factor, "outputs": ["accumulated"]})
            assert other.status_code == 200
            # sum: every block's gradient is 1, and each entry of V is in 2N pairs
            assert other.json()["accumulated"] == [[2.0 * n] * dim] * n
            rest = response.read()
        finally:
            sock.close()
        assert not slot_holders(workers)
    text = first + rest
    assert len(text) > 8 * 2 ** 20  # far more than the socket buffers hold: the writes did wait
    answer = orjson.loads(text)
    # The literal loop in float64 on the float32 values: sum_of_squares has no cancelling terms,
    # so each loss and gradient entry is held to float32's relative tolerance.
    seed = reference_blocks(torch.tensor(vectors, dtype=torch.float64), factor, "sum_of_squares", 5.0)
    assert [(b["row"], b["col"]) for b in answer["blocks"]] == [(r, c) for r in range(factor) for c in range(factor)]
    for block, (loss, gradient) in zip(answer["blocks"], seed, strict=True):
        assert_matches(block["gradient"], gradient, "float32", what=f"block {block['row'], block['col']} gradient")
        assert_matches([block["loss"]], [loss.item()], "float32", what=f"block {block['row'], block['col']} loss")
