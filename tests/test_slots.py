"""Pod-wide compute slots between real processes (forked, as gunicorn's workers are): two
hold the two slots at once, a third waits until one is released, a SIGKILLed holder's slot
is free again, waiters go first, and the counts say who holds what."""
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.serving import slots as pod

ROOT = Path(__file__).resolve().parent.parent
WAIT_S = 60.0  # bounds every wait; reached only when something is broken
FORK = multiprocessing.get_context("fork")


@pytest.fixture
def two_slots(tmp_path):
    slots = pod.create(2, parent=str(tmp_path))  # as the master does, before forking
    yield slots
    pod.remove(slots)


def holder(slots, report, go, blocking):
    """A worker: take a slot (waiting for one if `blocking`), say so, hold it until `go`."""
    slot = slots.acquire(timeout=WAIT_S) if blocking else slots.try_acquire()
    report.put((os.getpid(), slot is not None, slots.held_here()))
    if slot is not None:
        go.wait(WAIT_S)
        slot.release()
    report.put((os.getpid(), "released", slots.held_here()))


def start_holder(slots, blocking=True):
    report, go = FORK.Queue(), FORK.Event()
    process = FORK.Process(target=holder, args=(slots, report, go, blocking), daemon=True)
    process.start()
    return process, report, go


def wait_until(predicate, what):
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


def stop(*processes):
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join(WAIT_S)


def test_two_processes_hold_the_two_slots_at_once_and_a_third_waits_for_one(two_slots):
    (a, report_a, go_a), (b, report_b, go_b) = start_holder(two_slots), start_holder(two_slots)
    try:
        assert report_a.get(timeout=WAIT_S) == (a.pid, True, 1)
        assert report_b.get(timeout=WAIT_S) == (b.pid, True, 1)
        state = two_slots.pod_state()
        assert state.busy == two_slots.busy == 2
        assert state.holders == {a.pid: 1, b.pid: 1}
        assert two_slots.try_acquire() is None  # none left for this process either
        assert two_slots.held_here() == 0
        c, report_c, go_c = start_holder(two_slots)
        try:
            wait_until(lambda: two_slots.pod_state().waiting_processes == 1, "the third process waits")
            assert report_c.empty()  # it cannot have a slot: both are held
            go_a.set()
            assert report_c.get(timeout=WAIT_S) == (c.pid, True, 1)
            assert report_a.get(timeout=WAIT_S) == (a.pid, "released", 0)
            state = two_slots.pod_state()
            assert state.holders == {b.pid: 1, c.pid: 1} and state.waiting_processes == 0
            go_b.set(), go_c.set()
            report_b.get(timeout=WAIT_S), report_c.get(timeout=WAIT_S)
            wait_until(lambda: two_slots.busy == 0, "every slot released")
        finally:
            stop(c)
    finally:
        stop(a, b)


def test_a_sigkilled_holder_frees_its_slot_for_a_waiting_process(two_slots):
    (a, report_a, _), (b, report_b, go_b) = start_holder(two_slots), start_holder(two_slots)
    try:
        report_a.get(timeout=WAIT_S), report_b.get(timeout=WAIT_S)
        c, report_c, go_c = start_holder(two_slots)
        try:
            wait_until(lambda: two_slots.pod_state().waiting_processes == 1, "the third process waits")
            os.kill(a.pid, signal.SIGKILL)  # no release, no wake-up post: the kernel drops its lock
            a.join(WAIT_S)
            assert report_c.get(timeout=WAIT_S) == (c.pid, True, 1)
            assert two_slots.pod_state().holders == {b.pid: 1, c.pid: 1}  # the dead pid is gone
            go_b.set(), go_c.set()
        finally:
            stop(c)
    finally:
        stop(a, b)


def test_one_process_holds_several_slots_and_counts_them(two_slots):
    first = two_slots.try_acquire()
    second = two_slots.try_acquire()
    assert first is not None and second is not None and first.index != second.index
    assert two_slots.held_here() == 2 and two_slots.busy == 2
    assert two_slots.pod_state().holders == {os.getpid(): 2}
    assert two_slots.try_acquire() is None
    assert two_slots.acquire(timeout=0.05) is None  # a bounded wait gives up
    first.release()
    first.release()  # idempotent: one release frees one slot
    assert two_slots.held_here() == 1 and two_slots.busy == 1
    again = two_slots.acquire(timeout=WAIT_S)
    assert again is not None and again.index == first.index
    again.release(), second.release()
    assert two_slots.busy == 0


def test_a_waiting_process_goes_before_a_non_blocking_taker(tmp_path):
    slots = pod.create(1, parent=str(tmp_path))
    try:
        mine = slots.try_acquire()
        waiter, report, go = start_holder(slots)
        try:
            wait_until(lambda: slots.pod_state().waiting_processes == 1, "the other process waits")
            mine.release()
            # Whether or not the waiter has taken it yet, it is not this process's to take.
            assert slots.try_acquire() is None
            assert report.get(timeout=WAIT_S) == (waiter.pid, True, 1)
            go.set()
        finally:
            stop(waiter)
    finally:
        pod.remove(slots)


def test_a_forked_child_holds_none_of_its_parents_slots(tmp_path):
    slots = pod.create(1, parent=str(tmp_path))
    try:
        mine = slots.try_acquire()
        child, report, go = start_holder(slots, blocking=False)
        try:
            assert report.get(timeout=WAIT_S) == (child.pid, False, 0)
        finally:
            stop(child)
        mine.release()
        assert slots.busy == 0
    finally:
        pod.remove(slots)


def test_slots_attached_from_another_process_tree_conflict_and_poll(two_slots):
    """A process not forked from the creator (no wake-up semaphore) still shares the slots."""
    code = ("import sys, time; from app.serving.slots import PodSlots; s = PodSlots(sys.argv[1]); "
            "a = s.try_acquire(); b = s.try_acquire(); print(a is not None, b is None, flush=True); "
            "sys.stdin.readline()")
    mine = two_slots.try_acquire()
    assert mine is not None
    other = subprocess.Popen([sys.executable, "-c", code, two_slots.path], cwd=ROOT, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().split() == ["True", "True"]  # one free, the second not
        assert two_slots.busy == 2
        mine.release()
        other.stdin.write("\n"), other.stdin.flush()
        other.wait(WAIT_S)
        assert two_slots.busy == 0
    finally:
        other.kill()
        other.wait(WAIT_S)


def test_slots_module_loads_neither_torch_nor_flask():
    code = ("import sys; import app.serving.slots; "
            "print(sorted(m for m in ('torch', 'flask', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_executor_runs_tiles_on_the_pods_slots(two_slots):
    """The pod's slots are a SlotSource: two chunks that wait for each other both finish only
    when the second slot lets them run at once; afterwards only the request's own is held."""
    import threading

    from app.core.run import LocalExecutor

    barrier = threading.Barrier(2, timeout=WAIT_S)
    own = two_slots.try_acquire()
    executor = LocalExecutor(two_slots, slots_per_request=2, threads=two_slots.count)

    def chunk(k):
        if k < 2:
            barrier.wait()
        return k

    try:
        assert list(executor.map_chunks(chunk, range(8))) == list(range(8))
        assert two_slots.held_here() == 1
    finally:
        executor.shutdown()
        own.release()
    assert two_slots.busy == 0


def sibling(slots, commands, report):
    """A worker of the pod that marks itself as told: ("ready" | "serving" | "slot", bool)."""
    held = None
    for _ in range(100):
        command = commands.get(timeout=WAIT_S)
        if command is None:
            return
        what, on = command
        if what == "ready":
            slots.mark_ready(on)
        elif what == "serving":
            slots.mark_serving(on)
        elif what == "connections":
            slots.mark_connections(on)
        elif on:
            held = slots.try_acquire()
        elif held is not None:
            held.release()
        report.put(command)


class Sibling:
    def __init__(self, slots):
        self.commands, self.report = FORK.Queue(), FORK.Queue()
        self.process = FORK.Process(target=sibling, args=(slots, self.commands, self.report), daemon=True)
        self.process.start()

    def tell(self, what: str, on: bool | int = True) -> None:
        self.commands.put((what, on))
        assert self.report.get(timeout=WAIT_S) == (what, on)


def test_a_busy_worker_leaves_a_connection_only_to_a_ready_sibling(two_slots):
    """The balancing rule: a ready sibling that serves nothing takes it; one that is still
    booting (not ready), stopping (ready cleared) or dead never would, so it does not count."""
    two_slots.mark_serving(True)  # this process plays the busy worker
    assert not two_slots.sibling_should_take()  # no sibling at all
    other = Sibling(two_slots)
    try:
        assert not two_slots.sibling_should_take()  # alive, not serving, but still booting
        other.tell("ready")
        assert two_slots.pod_state().ready == {other.process.pid}
        assert two_slots.sibling_should_take()  # ready and idle
        other.tell("serving")
        assert not two_slots.sibling_should_take()  # ready, serving, and this process holds no slot
        other.tell("serving", False)
        other.tell("ready", False)  # stopping gracefully
        assert not two_slots.sibling_should_take()
        other.tell("ready")
        assert two_slots.sibling_should_take()
        os.kill(other.process.pid, signal.SIGKILL)
        other.process.join(WAIT_S)
        assert two_slots.pod_state().ready == frozenset()  # the kernel dropped the dead one's mark
        assert not two_slots.sibling_should_take()
    finally:
        stop(other.process)


def test_a_worker_holding_more_slots_than_a_serving_sibling_leaves_it_the_connection(two_slots):
    """Both serving: the one holding more slots (a lone request spread over the pod) leaves the
    next connection to the other; one each, neither does."""
    other = Sibling(two_slots)
    two_slots.mark_serving(True)
    try:
        other.tell("ready"), other.tell("serving")
        assert not two_slots.sibling_should_take()  # neither holds a slot
        mine = two_slots.try_acquire()
        second = two_slots.try_acquire()
        assert mine is not None and second is not None
        assert two_slots.sibling_should_take()  # two here, none there
        second.release()
        other.tell("slot")
        assert two_slots.pod_state().holders == {os.getpid(): 1, other.process.pid: 1}
        assert not two_slots.sibling_should_take()  # one each
        mine.release()
        other.commands.put(None)
    finally:
        stop(other.process)


def test_among_serving_workers_connections_rank_before_slots(two_slots):
    """Both serving: the sibling with fewer connections takes the next one even while it holds
    a slot and this worker none, since a kept-alive client stays where it lands and the slots
    held change with every request (docs/cores.md); connections even, fewer slots takes it."""
    other = Sibling(two_slots)
    two_slots.mark_serving(True)
    try:
        other.tell("ready"), other.tell("serving"), other.tell("slot"), other.tell("connections", 1)
        two_slots.mark_connections(2)
        assert two_slots.pod_state().holders == {other.process.pid: 1}
        assert two_slots.sibling_should_take()  # fewer connections there, though it computes
        two_slots.mark_connections(1)
        assert not two_slots.sibling_should_take()  # even: the sibling holds a slot, this worker none
        other.commands.put(None)
    finally:
        stop(other.process)


def test_connections_go_to_the_worker_holding_fewer(two_slots):
    """Kept-alive clients spread: of two workers in the same state, the one holding more
    connections leaves a new one to the other, idle or serving alike; serving ranks first."""
    other = Sibling(two_slots)
    try:
        other.tell("ready")
        two_slots.mark_connections(2)
        other.tell("connections", 2)
        assert two_slots.pod_state().connections == {os.getpid(): 2, other.process.pid: 2}
        assert not two_slots.sibling_should_take()  # even
        two_slots.mark_connections(3)
        assert two_slots.sibling_should_take()  # both idle: the sibling holds fewer
        two_slots.mark_serving(True), other.tell("serving")
        assert two_slots.sibling_should_take()  # both serving: still fewer there
        two_slots.mark_serving(False)
        assert not two_slots.sibling_should_take()  # idle here, the sibling serves: take it
        two_slots.mark_connections(0)
        assert two_slots.pod_state().connections == {other.process.pid: 2}
        other.commands.put(None)
    finally:
        stop(other.process)
