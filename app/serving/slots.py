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

`pod_state()` reads /proc/locks (Linux; elsewhere a process sees only itself): which
processes hold how many slots and how many wait, without touching the locks (a probe would
make a concurrent try fail), and what each worker says of itself with shared flocks on
marker files: ready (`ready`, taken once booted), serving (`serving`), and how many
connections it holds (`conns-1` to `conns-<CONN_LEVELS>`, one per connection). By these a
worker leaves a new connection to a sibling (`sibling_should_take`). A dead worker's marks
go with its process.

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
from collections import Counter
from contextlib import suppress
from dataclasses import dataclass, field

POLL_S = 0.05  # longest a waiter sleeps without a wake-up (a killed holder posts none)
SLOT_PREFIX = "slot-"
WAITING_NAME = "waiting"
SERVING_NAME = "serving"  # a shared flock on it: this worker has connections being served
READY_NAME = "ready"  # a shared flock on it: this worker has booted and takes connections
CONNS_PREFIX = "conns-"  # conns-k: a shared flock on it while this worker holds at least k connections
CONN_LEVELS = 8  # connections counted per worker at most: past it, workers are even
MARKERS = (SERVING_NAME, READY_NAME, *(f"{CONNS_PREFIX}{level}" for level in range(1, CONN_LEVELS + 1)))
PROC_LOCKS = "/proc/locks"


def create(count: int, parent: str | None = None) -> "PodSlots":
    """In the master, before forking: `count` slot files in a fresh directory under
    `parent`, and the wake-up semaphore the workers inherit."""
    path = tempfile.mkdtemp(prefix="blockgrad-slots-", dir=parent)
    for name in [f"{SLOT_PREFIX}{index}" for index in range(count)] + [WAITING_NAME, *MARKERS]:
        open(os.path.join(path, name), "w").close()
    # Starts at 0; bounded by count, so releases nobody waited for leave at most count
    # stale posts. The fork context unlinks its name at once: nothing to clean up.
    wake = multiprocessing.get_context("fork").BoundedSemaphore(count)
    for _ in range(count):
        wake.acquire()
    return PodSlots(path, wake)


def remove(slots: "PodSlots") -> None:
    """In the master, on exit."""
    shutil.rmtree(slots.path, ignore_errors=True)


def lock_key(path: str) -> str:
    """A file as /proc/locks names it: major:minor:inode (the kernel's "%02x:%02x:%lu")."""
    st = os.stat(path)
    return f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"


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
        self._slot_keys = {lock_key(p): index for index, p in enumerate(self.paths)}
        self._marker_keys = {lock_key(os.path.join(path, name)): name for name in (WAITING_NAME, *MARKERS)}
        self._lock = threading.Lock()
        self._opened: list = []
        self._close()
        _INSTANCES.add(self)

    # --- taking and giving back -------------------------------------------------------
    def try_acquire(self) -> PodSlot | None:
        """A slot free right now, unless a request in the pod is waiting for one."""
        with self._lock:
            self._open()
            if self._waiting:
                return None
            try:  # conflicts with any process's shared lock on the waiting file
                fcntl.flock(self._probe_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return None
            fcntl.flock(self._probe_file, fcntl.LOCK_UN)
            return self._take()

    def acquire(self, timeout: float | None = None) -> PodSlot | None:
        """A slot, waiting at most `timeout` seconds (None: no limit); None on timeout."""
        expires = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            self._open()
            self._waiting += 1
            if self._waiting == 1:
                fcntl.flock(self._markers[WAITING_NAME], fcntl.LOCK_SH)  # waits only out another's probe
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
            with self._lock:
                if self._pid is not None:  # else forked meanwhile: this process never waited
                    self._waiting -= 1
                    if self._waiting == 0:
                        fcntl.flock(self._markers[WAITING_NAME], fcntl.LOCK_UN)

    def held_here(self) -> int:
        """Slots this process holds now."""
        with self._lock:
            return len(self._held) if self._pid is not None else 0

    @property
    def busy(self) -> int:
        """Slots held anywhere in the pod."""
        return self.pod_state().busy

    # --- what a worker says of itself, as shared flocks on marker files (the kernel drops a
    # dead process's): serving connections now, booted and taking them, how many it holds ---
    def mark_serving(self, serving: bool) -> None:
        with self._lock:
            self._mark(SERVING_NAME, serving)

    def mark_ready(self, ready: bool) -> None:
        """Set once booted, cleared when it stops: only ready siblings are left a connection
        (`sibling_should_take`), a booting or dead one would never accept it."""
        with self._lock:
            self._mark(READY_NAME, ready)

    def mark_connections(self, count: int) -> None:
        """Up to CONN_LEVELS; a flock per connection opened or closed, none per request."""
        with self._lock:
            for level in range(1, CONN_LEVELS + 1):
                self._mark(f"{CONNS_PREFIX}{level}", level <= count)

    def sibling_should_take(self) -> bool:
        """Whether a new connection is better left to a ready sibling than taken here: one
        ranks before this worker by (serving, connections held, slots held). So an idle
        sibling takes it from a serving worker; among serving ones, the one with fewer
        connections (a kept-alive client stays where it lands, while the slots held change
        with every request: docs/cores.md), then the one holding fewer slots (a lone request
        spread over every slot leaves the next to a sibling, whose request then gets a slot
        at the next chunk boundary). The first in that order always accepts (ties all do),
        and a booting, stopping or dead sibling never counts. One read of /proc/locks; a
        worker asks only when a new connection is waiting."""
        state = self.pod_state()
        # Its own marks as it knows them, not as last read (none before this process opened the files).
        mine = (SERVING_NAME in self._marked, sum(n.startswith(CONNS_PREFIX) for n in self._marked), len(self._held))
        return any((pid in state.serving, state.connections.get(pid, 0), state.holders.get(pid, 0)) < mine
                   for pid in state.ready - {os.getpid()})

    def pod_state(self) -> PodState:
        try:
            with open(PROC_LOCKS) as f:
                text = f.read()
        except OSError:  # no /proc: what this process knows of itself
            here = self.held_here()
            return PodState(here, {os.getpid(): here} if here else {}, int(self._waiting > 0))
        held: dict[int, int] = {}  # slot index -> pid
        marked: dict[str, set[int]] = {}  # marker -> pids holding a lock on it
        connections: dict[int, int] = {}
        for line in text.splitlines():
            parts = line.split()
            if len(parts) < 6 or parts[1] != "FLOCK":  # "->" lines are blocked requests
                continue
            key, pid = parts[5], int(parts[4])
            if key in self._slot_keys:
                held[self._slot_keys[key]] = pid
            elif key in self._marker_keys:
                name = self._marker_keys[key]
                marked.setdefault(name, set()).add(pid)
                if name.startswith(CONNS_PREFIX):
                    connections[pid] = max(connections.get(pid, 0), int(name[len(CONNS_PREFIX):]))
        return PodState(len(held), dict(Counter(held.values())), len(marked.get(WAITING_NAME, ())),
                        frozenset(marked.get(SERVING_NAME, ())), frozenset(marked.get(READY_NAME, ())), connections)

    # --- inside -----------------------------------------------------------------------
    def _open(self) -> None:
        """This process's own descriptors, opened on first use in each process."""
        if self._pid is not None:  # reset in a forked child (_after_fork_in_child)
            return
        self._files = [open(p, "r") for p in self.paths]
        self._markers = {name: open(os.path.join(self.path, name), "r") for name in (WAITING_NAME, *MARKERS)}
        self._probe_file = open(os.path.join(self.path, WAITING_NAME), "r")  # a description of its own
        self._opened = [*self._files, *self._markers.values(), self._probe_file]
        self._held, self._waiting, self._marked = set(), 0, set()
        self._pid = os.getpid()

    def _close(self) -> None:
        for f in self._opened:
            f.close()
        self._opened, self._held, self._waiting, self._marked, self._pid = [], set(), 0, set(), None

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()  # the parent's may have been held by another thread
        self._close()  # the parent's descriptors: holding them would keep its locks alive

    def _mark(self, name: str, on: bool) -> None:
        self._open()
        if on != (name in self._marked):
            fcntl.flock(self._markers[name], fcntl.LOCK_SH if on else fcntl.LOCK_UN)
            (self._marked.add if on else self._marked.discard)(name)

    def _take(self) -> PodSlot | None:
        self._open()
        start = self._pid % self.count  # processes start apart: fewer failed tries
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
            if self._pid != slot.pid or slot.index not in self._held:
                return  # taken before a fork: this process never held it
            fcntl.flock(self._files[slot.index], fcntl.LOCK_UN)
            self._held.discard(slot.index)
        if self._wake is not None:
            with suppress(ValueError):  # already `count` posts pending: enough to wake every waiter
                self._wake.release()



_INSTANCES: "weakref.WeakSet[PodSlots]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for slots in list(_INSTANCES):
        slots._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
