"""The read alarm's watchdog (app/http/body.py): an armed action runs at its time, a
cancelled one never does, an earlier alarm wakes the sleeping thread, and the alarms of
requests whose bodies arrived (armed, then cancelled) leave nothing behind to wake for."""
import threading
import time

from app.http.body import Watchdog

WAIT_S = 30.0  # bound of every wait; reached only on failure


def test_an_alarm_fires_and_a_cancelled_one_never_does():
    dog, fired, kept = Watchdog(), threading.Event(), []
    late = dog.arm(WAIT_S * 10, lambda: kept.append("late"))  # the thread sleeps for this one
    with dog._cond:  # armed and cancelled before the thread can look: however slow this thread is
        cancelled = dog.arm(0.01, lambda: kept.append("cancelled"))
        dog.cancel(cancelled)
    soon = dog.arm(0.05, fired.set)  # due before the one the thread sleeps for: it must wake
    assert fired.wait(WAIT_S) and soon.fired
    assert kept == [] and not cancelled.fired and not late.fired
    dog.cancel(late)
    assert dog.pending() == 0


def test_armed_and_cancelled_alarms_leave_nothing_behind():
    dog = Watchdog()
    keeper = dog.arm(WAIT_S * 10, lambda: None)
    for _ in range(1000):  # as requests whose bodies arrived at once
        dog.cancel(dog.arm(WAIT_S, lambda: None))
    assert dog.pending() == 1  # only the live one: no cancelled alarm left to wake the thread
    dog.cancel(keeper)
    assert dog.pending() == 0


def test_an_alarm_fires_although_older_ones_were_cancelled_out_of_order():
    dog, fired = Watchdog(), threading.Event()
    with dog._cond:  # armed and cancelled before the thread can look: however slow this thread is
        first, second = dog.arm(0.02, lambda: None), dog.arm(0.03, lambda: None)
        third = dog.arm(0.04, fired.set)
        dog.cancel(second)  # behind a live one: stays until it reaches the front
        dog.cancel(first)  # now both leave the front
        assert dog.pending() == 1
    assert fired.wait(WAIT_S) and third.fired
    deadline = time.monotonic() + WAIT_S
    while dog.pending() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert dog.pending() == 0 and not first.fired and not second.fired
