"""The compute gate (app/core/slots.py): one slot, a bounded FIFO queue, deadlines and
cancellation while waiting. Threads only; every wait bounded; no timing verdicts: a
waiter's deadline is either already past or far away (60 s) and released explicitly."""
import threading

import pytest

from app.core.errors import BlockgradError
from app.core.slots import Deadline, Gate, GateListener

FAR = 60.0
JOIN_S = 30


class Recorder(GateListener):
    def __init__(self):
        self.depths, self.waits, self.sheds = [], [], 0

    def waiting(self, depth):
        self.depths.append(depth)

    def waited(self, seconds):
        self.waits.append(seconds)

    def shed(self):
        self.sheds += 1


def wait_for(predicate, limit=JOIN_S):
    event = threading.Event()
    for _ in range(int(limit / 0.01)):
        if predicate():
            return True
        event.wait(0.01)
    return predicate()


def waiter(gate, outcomes, name, deadline=None):
    def run():
        try:
            ticket = gate.acquire(deadline or Deadline(FAR))
            outcomes.append(name)
            ticket.release()
        except BlockgradError as exc:
            outcomes.append((name, exc.code, exc.details))
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_free_slot_is_taken_at_once_and_released_once():
    recorder = Recorder()
    gate = Gate(queue_depth=2, listener=recorder)
    ticket = gate.acquire(Deadline(FAR))
    assert gate.busy == 1 and recorder.waits == [0.0]
    ticket.release()
    ticket.release()  # idempotent: a stream's end and its close both release
    assert gate.busy == 0


def test_full_queue_sheds_at_once_with_retry_after():
    recorder = Recorder()
    gate = Gate(queue_depth=2, listener=recorder)
    holder = gate.acquire(Deadline(FAR))
    outcomes = []
    threads = [waiter(gate, outcomes, k) for k in range(2)]
    assert wait_for(lambda: gate.depth == 2)
    with pytest.raises(BlockgradError) as refused:
        gate.acquire(Deadline(FAR))
    assert refused.value.code == "overloaded" and refused.value.retry_after_s >= 1
    assert recorder.sheds == 1
    holder.release()
    for thread in threads:
        thread.join(JOIN_S)
    assert outcomes == [0, 1]  # first come, first served
    assert gate.busy == 0 and gate.depth == 0 and recorder.depths[-1] == 0


def test_deadline_passing_in_the_queue_is_deadline_exceeded_queued():
    gate = Gate(queue_depth=2)
    holder = gate.acquire(Deadline(FAR))
    outcomes = []
    waiter(gate, outcomes, "late", Deadline(FAR, started=-1e9)).join(JOIN_S)  # arrived long ago
    assert outcomes == [("late", "deadline_exceeded", {"timeout_s": FAR, "queued": True})]
    assert gate.depth == 0
    holder.release()


def test_a_waiter_whose_client_left_gives_up_its_place():
    gate = Gate(queue_depth=2)
    holder = gate.acquire(Deadline(FAR))
    gone = threading.Event()
    outcomes = []
    thread = waiter(gate, outcomes, "gone", Deadline(FAR, cancelled=gone.is_set))
    assert wait_for(lambda: gate.depth == 1)
    gone.set()
    thread.join(JOIN_S)
    assert outcomes == [("gone", "client_closed", {})]
    assert gate.depth == 0
    holder.release()
    # The slot is free at once: a deadline already past would fail any acquire that had to wait.
    ticket = gate.acquire(Deadline(0.0))
    assert gate.busy == 1 and gate.depth == 0
    ticket.release()
    assert gate.busy == 0


def test_deadline_check_stops_a_computation_whose_client_left():
    gone = threading.Event()
    deadline = Deadline(FAR, cancelled=gone.is_set)
    deadline.check()
    gone.set()
    deadline.next_poll = 0.0  # polled at most every CANCEL_POLL_S; force the next check to look
    with pytest.raises(BlockgradError) as stopped:
        deadline.check()
    assert stopped.value.code == "client_closed"
