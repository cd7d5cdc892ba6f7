"""Turns (app/serving/turns.py): one request at a time in arrival order, whoever read its head
(the main loop, or a pool thread from a lingering connection), the next after the running one
ends or after hold_s.

Events, not times: "waits for the running one" is shown with a hold of a minute that the test
ends long before by finishing; "runs beside after hold_s" with a hold of 10 ms against a running
request that never ends. Every wait is bounded."""
import threading
from queue import Empty, SimpleQueue

from app.serving.turns import Turns
from tools.server import wait_until

WAIT_S = 30.0  # bound of every wait; reached only on failure
LONG_HOLD_S = 60.0


def waiter(turns: Turns, item, log: list) -> threading.Thread:
    """A pool thread with a complete head for `item`: logs it once its turn has come."""
    thread = threading.Thread(target=lambda: (turns.wait_for_turn(item), log.append(item)), daemon=True)
    thread.start()
    return thread


def queued(turns: Turns, count: int) -> bool:
    """Wait until `count` items wait for their turn."""
    return wait_until(lambda: len(turns._queue) >= count, WAIT_S, 0.001)


def test_with_nothing_running_the_first_takes_its_turn_at_once():
    turns, log = Turns(LONG_HOLD_S), []
    waiter(turns, "a", log).join(WAIT_S)
    assert log == ["a"] and turns.running == 1


def test_a_thread_s_next_request_waits_for_the_running_one_to_end():
    turns, log = Turns(LONG_HOLD_S), []
    turns.add("first", now=0.0)
    assert turns.due(now=0.0) == ["first"] and turns.running == 1
    thread = waiter(turns, "next", log)
    assert queued(turns, 1) and log == []  # held: one request runs
    turns.finish()  # ending it wakes the waiting thread
    thread.join(WAIT_S)
    assert log == ["next"] and turns.running == 1


def test_past_the_hold_a_waiting_request_runs_beside_the_running_one():
    turns, log = Turns(0.01), []
    turns.add("long", now=0.0)
    assert turns.due(now=0.0) == ["long"]
    waiter(turns, "next", log).join(WAIT_S)  # "long" never ends
    assert log == ["next"] and turns.running == 2
    with turns._lock:
        assert not turns._queue


def test_the_main_loop_starts_the_first_at_once_and_the_rest_after_the_hold():
    turns = Turns(1.0)
    for name in ("a", "b", "c"):
        turns.add(name, now=10.0)
    assert turns.due(now=10.0) == ["a"]
    assert turns.oldest() == 10.0
    assert turns.due(now=10.5) == []
    assert turns.due(now=11.0) == ["b", "c"] and turns.running == 3


def test_turns_follow_arrival_order_whoever_read_the_head():
    turns, log = Turns(LONG_HOLD_S), []
    turns.add("running", now=0.0)
    turns.due(now=0.0)
    turns.add("polled", now=0.0)  # read by the main loop, before the thread's
    thread = waiter(turns, "lingered", log)
    assert queued(turns, 2)
    # Ending a request leaves the main loop's item for the thread's own take_next.
    turns.finish()
    assert turns.running == 0
    assert turns.take_next() == "polled" and turns.running == 1
    assert log == []
    turns.finish()  # the thread's item is next: woken
    thread.join(WAIT_S)
    assert log == ["lingered"] and turns.running == 1
    assert turns.take_next() is None  # one runs, none waits


class WokenAsTheHoldEnds(SimpleQueue):
    """A thread's inbox whose hold expires just as the running request ends: the waker
    (finish) takes the entry off the queue before the waiter can, and every later blocking
    get finds nothing (a waker that has not put yet)."""

    def __init__(self, turns: Turns):
        super().__init__()
        self.turns, self.blocking_gets = turns, 0

    def get(self, block=True, timeout=None):
        self.blocking_gets += 1
        if self.blocking_gets == 1:
            self.turns.finish()  # the running request ends: wakes this one
        raise Empty


def test_a_request_woken_as_its_hold_ends_runs_without_waiting_again():
    turns = Turns(LONG_HOLD_S, new_inbox=lambda: WokenAsTheHoldEnds(turns))
    turns.add("running", now=0.0)
    assert turns.due(now=0.0) == ["running"]
    turns.wait_for_turn("next")  # raises Empty if it waits for a wake-up a second time
    inbox = turns._inboxes.inbox
    assert inbox.blocking_gets == 1 and inbox.empty()
    assert turns.running == 1 and not turns._queue  # counted once, by its waker
    assert turns.take_next() is None  # one runs: nothing else may start


def test_every_thread_waits_on_an_inbox_of_its_own():
    turns = Turns(LONG_HOLD_S)
    seen = []
    thread = threading.Thread(target=lambda: seen.append(turns._inbox()), daemon=True)
    thread.start()
    thread.join(WAIT_S)
    assert seen and seen[0] is not turns._inbox() and turns._inbox() is turns._inbox()
