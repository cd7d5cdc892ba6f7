"""The worker's pool threads (app/serving/threads.py): each connection handled once, sequential
hand-overs served by one thread, at most `size` at once with the rest in a backlog (its owner
told), a failing handle reported done as None, nothing served after shutdown (reported done),
and a thread that cannot start not counted against `size`. `handle` answers for its connection:
the tests' handle records what it returned, as the worker's hands it back itself."""
import queue
import threading
import time

import pytest

from app.serving.threads import ServingThreads

WAIT_S = 30.0  # bound of every wait; reached only on failure


def pool(size, handle, on_backlog=lambda: None):
    """(threads, done): `done` receives (conn, what handle returned) after each handle, and
    (conn, None) for each the pool reports done itself."""
    done: queue.SimpleQueue = queue.SimpleQueue()

    def handled(conn):
        done.put((conn, handle(conn)))
    return ServingThreads(size, handled, lambda conn, result: done.put((conn, result)),
                          on_backlog=on_backlog), done


def test_sequential_connections_are_served_by_one_thread():
    names = []
    threads, done = pool(4, lambda conn: names.append(threading.current_thread()) or conn * 2)
    for conn in range(20):
        threads.submit(conn)
        assert done.get(timeout=WAIT_S) == (conn, conn * 2)
        wait_idle(threads)  # `done` is reported just before the thread files itself idle
    assert len(set(names)) == 1  # each hand-over woke the one idle thread, never a second


def wait_idle(threads: ServingThreads) -> None:
    deadline = time.monotonic() + WAIT_S
    while not threads._idle and time.monotonic() < deadline:
        time.sleep(0.001)


def test_at_most_size_run_at_once_and_the_backlog_is_served():
    release, running, lock, most = threading.Event(), [0], threading.Lock(), [0]

    def handle(conn):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        release.wait(WAIT_S)
        with lock:
            running[0] -= 1
        return True

    backlogged = []
    threads, done = pool(2, handle, on_backlog=lambda: backlogged.append(True))
    for conn in range(6):
        threads.submit(conn)
    assert len(backlogged) == 4  # told of each connection left waiting for a thread
    deadline = time.monotonic() + WAIT_S
    while running[0] < 2 and time.monotonic() < deadline:  # both threads inside handle: the rest wait
        time.sleep(0.001)
    release.set()
    served = sorted(done.get(timeout=WAIT_S)[0] for _ in range(6))
    assert served == list(range(6)) and most[0] == 2


def test_a_failing_handle_is_reported_as_none_and_the_thread_goes_on():
    def handle(conn):
        if conn == "bad":
            raise OSError("reset")
        return True

    threads, done = pool(1, handle)
    threads.submit("bad")
    assert done.get(timeout=WAIT_S) == ("bad", None)
    threads.submit("good")
    assert done.get(timeout=WAIT_S) == ("good", True)


def test_after_shutdown_a_connection_is_reported_unserved():
    handled = []
    threads, done = pool(2, lambda conn: handled.append(conn) or True)
    threads.submit(1)
    assert done.get(timeout=WAIT_S) == (1, True)
    threads.shutdown()
    threads.submit(2)
    assert done.get(timeout=WAIT_S) == (2, None) and handled == [1]


def test_a_thread_done_with_one_takes_the_next_held_back_without_a_hand_over():
    held = [3, 2]  # what the owner holds back, taken last first
    names = []
    threads, done = pool(4, lambda conn: names.append(threading.current_thread()) or True)
    threads.take_next = lambda: held.pop() if held else None
    threads.submit(1)
    assert [done.get(timeout=WAIT_S)[0] for _ in range(3)] == [1, 2, 3]
    assert len(set(names)) == 1 and held == []


def test_a_thread_that_cannot_start_is_not_counted(monkeypatch):
    threads, done = pool(1, lambda conn: True)
    with monkeypatch.context() as patched:
        def refuse(thread):
            raise RuntimeError("can't start new thread")
        patched.setattr(threading.Thread, "start", refuse)
        with pytest.raises(RuntimeError):
            threads.submit(1)
    threads.submit(2)  # the pool's one thread is still free to start, not a backlog
    assert done.get(timeout=WAIT_S) == (2, True) and not threads.backlogged()
