"""Compute slots shared by every worker of a pod: one lock file per core.

The master creates a directory with one file per slot before it forks (`create`). A
worker holds a slot while it holds an exclusive flock on the slot's file, taken without
blocking on whichever file is free. The kernel drops the flock of a process that dies,
however it dies (SIGKILL included), so a dead worker's slots are free again at once with
no reclaiming code. Locks belong to the open file description, so every process opens
the files itself (after fork: inherited descriptors are closed in the child); threads
of one process share its descriptors, so the process keeps its own set of held slots.

Waiting (`acquire`): a waiter holds a shared flock on the `waiting` file, so that
`try_acquire` anywhere in the pod defers to it, then tries the slots each time a release
posts to a wake-up semaphore the master made before forking, or every POLL_S at the
latest. The semaphore is only a hint: a SIGKILLed holder posts nothing, and the poll
then finds its slot. A semaphore as the slots themselves would not be SIGKILL-safe, nor
would a shared multiprocessing.Condition (a holder killed inside it leaves it locked);
docs/cores.md says why this mechanism.

`pod_state()` reads /proc/locks: which processes hold how many slots and how many
wait, without touching the locks (a probe would make a concurrent try fail), and what
each worker says of itself with shared flocks on marker files: ready (`ready`, taken once
booted), serving (`serving`), and how many connections it holds (`conns-1` to
`conns-<CONN_LEVELS>`, one per connection). By these a worker leaves a new connection to a
sibling (`sibling_should_take`). A dead worker's marks go with its process.

Standard library only: the master imports this, never torch or Flask.
"""
import fcntl
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field

POLL_S = 0.05  # longest a waiter sleeps without a wake-up (a killed holder posts none)
SLOT_PREFIX = "slot-"
WAITING_NAME = "waiting"
SERVING_NAME = "serving"  # a shared flock on it: this worker has connections being served
READY_NAME = "ready"  # a shared flock on it: this worker has booted and takes connections
CONNS_PREFIX = "conns-"  # conns-k: a shared flock on it while this worker holds at least k connections
CONN_LEVELS = 8  # connections counted per worker at most: past it, workers are even
PROC_LOCKS = "/proc/locks"


def create(count: int, parent: str | None = None) -> "PodSlots":
    """In the master, before forking: `count` slot files in a fresh directory under
    `parent`, and the wake-up semaphore the workers inherit."""
    if count < 1:
        raise ValueError("a pod needs at least one compute slot")
    path = tempfile.mkdtemp(prefix="blockgrad-slots-", dir=parent)
    for index in range(count):
        open(os.path.join(path, f"{SLOT_PREFIX}{index}"), "w").close()
    open(os.path.join(path, WAITING_NAME), "w").close()
    open(os.path.join(path, SERVING_NAME), "w").close()
    open(os.path.join(path, READY_NAME), "w").close()
    for level in range(1, CONN_LEVELS + 1):
        open(os.path.join(path, f"{CONNS_PREFIX}{level}"), "w").close()
    # Starts at 0; bounded by count, so releases nobody waited for leave at most count
    # stale posts. The fork context unlinks its name at once: nothing to clean up.
    wake = multiprocessing.get_context("fork").BoundedSemaphore(count)
    for _ in range(count):
        wake.acquire()
    return PodSlots(path, wake)


def remove(slots: "PodSlots") -> None:
    """In the master, on exit."""
    shutil.rmtree(slots.path, ignore_errors=True)


@dataclass(frozen=True)
class PodState:
    busy: int  # slots held in the pod
    holders: dict[int, int]  # pid -> slots it holds
    waiting_processes: int  # processes with at least one thread waiting for a slot
    serving: frozenset[int] = frozenset()  # pids that marked themselves serving (`mark_serving`)
    ready: frozenset[int] = frozenset()  # pids that marked themselves ready (`mark_ready`)
    connections: dict[int, int] = field(default_factory=dict)  # pid -> connections (`mark_connections`), capped


class PodSlot:
    """One held slot; `release` is idempotent."""

    def __init__(self, owner: "PodSlots", index: int, pid: int):
        self.owner, self.index, self.pid = owner, index, pid
        self.released = False

    def release(self) -> None:
        self.owner._release(self)

    def __enter__(self) -> "PodSlot":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class PodSlots:
    """The pod's slots as one process sees them. Safe to share between its threads and to
    inherit across fork (the child starts holding nothing)."""

    def __init__(self, path: str, wake=None):
        self.path = path
        names = [name for name in os.listdir(path) if name.startswith(SLOT_PREFIX)]
        self.paths = [os.path.join(path, name) for name in sorted(names, key=lambda n: int(n[len(SLOT_PREFIX):]))]
        self.count = len(self.paths)
        if self.count < 1:
            raise ValueError(f"no slot files in {path}")
        self._wake = wake  # None (attached from another process tree): poll only
        keys = [os.stat(p) for p in self.paths] + [os.stat(os.path.join(path, WAITING_NAME))]
        self._slot_keys = {(os.major(s.st_dev), os.minor(s.st_dev), s.st_ino): i for i, s in enumerate(keys[:-1])}
        waiting = keys[-1]
        self._waiting_key = (os.major(waiting.st_dev), os.minor(waiting.st_dev), waiting.st_ino)
        self._serving_key = self._marker_key(SERVING_NAME)
        self._ready_key = self._marker_key(READY_NAME)
        self._conns_keys = {self._marker_key(f"{CONNS_PREFIX}{level}"): level for level in range(1, CONN_LEVELS + 1)}
        self._lock = threading.Lock()
        self._pid: int | None = None  # the process that opened the descriptors below
        self._files: list = []
        self._wait_file = self._probe_file = self._serving_file = self._ready_file = None
        self._serving = False  # whether this process holds its shared lock on the serving file
        self._ready = False  # whether it holds its shared lock on the ready file
        self._conns_files: list = []
        self._conns = 0  # conns-k files this process holds a shared lock on (k = 1.._conns)
        self._held: set[int] = set()
        self._waiting = 0  # this process's waiting threads
        _INSTANCES.add(self)

    # --- taking and giving back -------------------------------------------------------
    def try_acquire(self) -> PodSlot | None:
        """A slot free right now, unless a request in the pod is waiting for one."""
        with self._lock:
            self._open()
            if self._someone_waits():
                return None
            return self._take()

    def acquire(self, timeout: float | None = None) -> PodSlot | None:
        """A slot, waiting at most `timeout` seconds (None: no limit); None on timeout."""
        expires = None if timeout is None else time.monotonic() + timeout
        self._join_waiting()
        try:
            while True:
                with self._lock:
                    slot = self._take()
                if slot is not None:
                    return slot
                pause = POLL_S if expires is None else min(POLL_S, expires - time.monotonic())
                if pause <= 0:
                    return None
                if self._wake is not None:
                    self._wake.acquire(True, pause)
                else:
                    time.sleep(pause)
        finally:
            self._leave_waiting()

    def held_here(self) -> int:
        """Slots this process holds now."""
        with self._lock:
            return len(self._held) if self._pid == os.getpid() else 0

    def busy_slots(self) -> int:
        """Slots held anywhere in the pod."""
        return self.pod_state().busy

    @property
    def busy(self) -> int:  # SlotSource's name for it
        return self.busy_slots()

    def mark_serving(self, serving: bool) -> None:
        """Say (in /proc/locks, as a shared flock) whether this worker is serving connections
        now; the kernel drops the mark of a process that dies. The worker's main loop calls it."""
        with self._lock:
            self._open()
            if serving != self._serving:
                fcntl.flock(self._serving_file, fcntl.LOCK_SH if serving else fcntl.LOCK_UN)
                self._serving = serving

    def mark_ready(self, ready: bool) -> None:
        """Say whether this worker takes new connections: set once it has booted, cleared when
        it stops; the kernel drops it when the process dies. Only ready siblings are left a
        connection (`sibling_should_take`): a booting or dead one would never accept it."""
        with self._lock:
            self._open()
            if ready != self._ready:
                fcntl.flock(self._ready_file, fcntl.LOCK_SH if ready else fcntl.LOCK_UN)
                self._ready = ready

    def mark_connections(self, count: int) -> None:
        """Say how many connections this worker holds (up to CONN_LEVELS); a flock per
        connection opened or closed, none per request. One thread calls it."""
        with self._lock:
            self._open()
            count = max(0, min(count, CONN_LEVELS))
            while self._conns < count:
                fcntl.flock(self._conns_files[self._conns], fcntl.LOCK_SH)
                self._conns += 1
            while self._conns > count:
                self._conns -= 1
                fcntl.flock(self._conns_files[self._conns], fcntl.LOCK_UN)

    def sibling_should_take(self) -> bool:
        """Whether a new connection is better left to a ready sibling than taken here: one
        ranks before this worker by (serving, slots held, connections held). So an idle
        sibling takes it from a serving worker; among serving ones, the one holding fewer
        slots (a lone request spread over every slot leaves the next to a sibling, whose
        request then gets a slot at the next chunk boundary), then the one with fewer kept-
        alive connections. The first in that order always accepts (ties all do), and a
        booting, stopping or dead sibling never counts. One read of /proc/locks; a worker
        asks only when a new connection is waiting."""
        state = self.pod_state()
        me = os.getpid()
        siblings = state.ready - {me}
        if not siblings:
            return False

        def rank(pid: int) -> tuple[bool, int, int]:
            return pid in state.serving, state.holders.get(pid, 0), state.connections.get(pid, 0)
        mine = (self._serving, len(self._held), self._conns) if self._pid == me else rank(me)
        return any(rank(pid) < mine for pid in siblings)

    def pod_state(self) -> PodState:
        try:
            with open(PROC_LOCKS) as f:
                text = f.read()
        except OSError:
            return self._probed_state()
        held: dict[int, int] = {}  # slot index -> pid
        waiting, serving, ready = set(), set(), set()
        connections: dict[int, int] = {}
        for line in text.splitlines():
            parts = line.split()
            if len(parts) < 6 or parts[1] != "FLOCK":  # "->" lines are blocked requests
                continue
            try:
                major, minor, inode = parts[5].split(":")
                key = (int(major, 16), int(minor, 16), int(inode))
                pid = int(parts[4])
            except ValueError:
                continue
            if key in self._slot_keys:
                held[self._slot_keys[key]] = pid
            elif key == self._waiting_key:
                waiting.add(pid)
            elif key == self._serving_key:
                serving.add(pid)
            elif key == self._ready_key:
                ready.add(pid)
            elif key in self._conns_keys:
                connections[pid] = max(connections.get(pid, 0), self._conns_keys[key])
        holders: dict[int, int] = {}
        for pid in held.values():
            holders[pid] = holders.get(pid, 0) + 1
        return PodState(len(held), holders, len(waiting), frozenset(serving), frozenset(ready), connections)

    def close(self) -> None:
        """This process's descriptors (and so any slot it still holds)."""
        with self._lock:
            self._close()

    # --- inside -----------------------------------------------------------------------
    def _marker_key(self, name: str) -> tuple[int, int, int]:
        marker = os.path.join(self.path, name)
        open(marker, "a").close()  # a directory made before the marker existed
        st = os.stat(marker)
        return (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)

    def _open(self) -> None:
        """This process's own descriptors, opened on first use in each process."""
        if self._pid == os.getpid():
            return
        self._files = [open(p, "r") for p in self.paths]
        self._wait_file = open(os.path.join(self.path, WAITING_NAME), "r")
        self._probe_file = open(os.path.join(self.path, WAITING_NAME), "r")  # a description of its own
        self._serving_file = open(os.path.join(self.path, SERVING_NAME), "r")
        self._ready_file = open(os.path.join(self.path, READY_NAME), "r")
        self._conns_files = [open(os.path.join(self.path, f"{CONNS_PREFIX}{level}"), "r")
                             for level in range(1, CONN_LEVELS + 1)]
        self._held, self._waiting, self._serving, self._ready, self._conns = set(), 0, False, False, 0
        self._pid = os.getpid()

    def _close(self) -> None:
        for f in self._files + self._conns_files + [self._wait_file, self._probe_file, self._serving_file,
                                                     self._ready_file]:
            if f is not None:
                f.close()
        self._files, self._conns_files = [], []
        self._wait_file = self._probe_file = self._serving_file = self._ready_file = None
        self._held, self._waiting, self._pid, self._serving, self._ready, self._conns = set(), 0, None, False, False, 0

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()  # the parent's may have been held by another thread
        self._close()  # the parent's descriptors: holding them would keep its locks alive

    def _take(self) -> PodSlot | None:
        self._open()
        start = os.getpid() % self.count  # processes start apart: fewer failed tries
        for step in range(self.count):
            index = (start + step) % self.count
            if index in self._held:
                continue
            try:
                fcntl.flock(self._files[index], fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            self._held.add(index)
            return PodSlot(self, index, self._pid)
        return None

    def _release(self, slot: PodSlot) -> None:
        with self._lock:
            if slot.released:
                return
            slot.released = True
            if slot.pid != os.getpid() or self._pid != slot.pid or slot.index not in self._held:
                return  # taken before a fork: this process never held it
            fcntl.flock(self._files[slot.index], fcntl.LOCK_UN)
            self._held.discard(slot.index)
        if self._wake is not None:
            try:
                self._wake.release()
            except ValueError:  # already `count` posts pending: enough to wake every waiter
                pass

    def _someone_waits(self) -> bool:
        if self._waiting:
            return True
        try:  # conflicts with any process's shared lock on the waiting file
            fcntl.flock(self._probe_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(self._probe_file, fcntl.LOCK_UN)
        return False

    def _join_waiting(self) -> None:
        with self._lock:
            self._open()
            self._waiting += 1
            if self._waiting == 1:
                fcntl.flock(self._wait_file, fcntl.LOCK_SH)  # waits only out another's probe

    def _leave_waiting(self) -> None:
        with self._lock:
            if self._pid != os.getpid():
                return
            self._waiting -= 1
            if self._waiting == 0:
                fcntl.flock(self._wait_file, fcntl.LOCK_UN)

    def _probed_state(self) -> PodState:
        """Without /proc/locks: each slot not held here tried with a shared lock and let go."""
        with self._lock:
            self._open()
            busy = len(self._held)
            for index, f in enumerate(self._files):
                if index in self._held:
                    continue
                try:
                    fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:
                    busy += 1
                    continue
                fcntl.flock(f, fcntl.LOCK_UN)
            here = len(self._held)
        return PodState(busy, {os.getpid(): here} if here else {}, int(self._waiting > 0))


_INSTANCES: "weakref.WeakSet[PodSlots]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for slots in list(_INSTANCES):
        slots._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
