"""Compute slots, one per core, as the executor and the gate take them.

`SlotSource` is what both need: a slot now if one is free and nobody waits for one
(`try_acquire`), or a bounded wait for one (`acquire`). `ThreadSlots` are the slots of
one process (tests, a development server); gunicorn's workers share the pod's
(app/serving/slots.py), which satisfy the same protocol. Standard library only.
"""
import threading
from typing import Protocol


class Slot(Protocol):
    def release(self) -> None:
        """Give the slot back; idempotent."""


class SlotSource(Protocol):
    """Compute slots, one per core: local to a process or shared by a pod."""
    count: int  # slots in all

    @property
    def busy(self) -> int:
        """Slots held now, by anyone (in the pod, for the pod's)."""

    def try_acquire(self) -> Slot | None:
        """A slot free right now, unless someone is waiting for one (they go first)."""

    def acquire(self, timeout: float | None = None) -> Slot | None:
        """A slot, waiting at most `timeout` seconds (None: no limit); None on timeout."""


class LocalSlot:
    """One held slot of a ThreadSlots."""

    def __init__(self, source: "ThreadSlots"):
        self._source, self._released = source, False

    def release(self) -> None:
        with self._source._cond:
            if self._released:
                return
            self._released = True
            self._source._free += 1
            self._source._cond.notify()


class ThreadSlots:
    """Slots of one process (a development server, tests); a pod shares app/serving/slots.py's."""

    def __init__(self, count: int):
        self.count = count
        self._free = count
        self._waiting = 0
        self._cond = threading.Condition()

    @property
    def busy(self) -> int:
        with self._cond:
            return self.count - self._free

    def try_acquire(self) -> LocalSlot | None:
        with self._cond:
            if self._free == 0 or self._waiting:
                return None
            self._free -= 1
            return LocalSlot(self)

    def acquire(self, timeout: float | None = None) -> LocalSlot | None:
        with self._cond:
            self._waiting += 1
            try:
                if not self._cond.wait_for(lambda: self._free > 0, timeout):
                    return None
                self._free -= 1
                return LocalSlot(self)
            finally:
                self._waiting -= 1
