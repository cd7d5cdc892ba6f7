"""Freed heap memory handed back to the OS during pass one (glibc; elsewhere nothing).

Pass one allocates and frees a few temporaries of up to a chunk each (megabytes) per chunk,
and when it keeps blocks it also keeps a few small tensors per chunk. glibc serves those
small allocations from the holes the temporaries left, so the holes can be neither merged
nor returned and the heap grows far past what the request holds. `malloc_trim(0)` returns
the free pages inside the heap, but costs a walk of it and the pages' faults when reused,
so it runs only once the process's resident memory has grown by TRIM_SLACK_BYTES since the
last mark: ordinary requests never pay for it, and the growth stays within the slack
(app/core/admission.py counts it for requests that keep blocks). docs/benchmarks.md has the
measurements behind the slack.

`mallopt` is the one way the rest of the service sets glibc's allocator parameters (the
serving workers' arenas, the Dask workers' thresholds).
"""
import ctypes
import os

TRIM_SLACK_BYTES = 256 * 1024 * 1024
STATM = "/proc/self/statm"
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_PERTURB, M_ARENA_MAX = -1, -3, -6, -8


try:
    GLIBC = ctypes.CDLL("libc.so.6")
except OSError:  # not glibc
    GLIBC = None


def mallopt(param: int, value: int) -> bool:
    """glibc's mallopt(param, value): whether it took the value (False where this is not glibc)."""
    function = getattr(GLIBC, "mallopt", None)  # None where this is not glibc
    return function is not None and function(param, value) == 1


MALLOC_TRIM = getattr(GLIBC, "malloc_trim", None) if os.path.exists(STATM) else None


def resident_bytes() -> int:
    with open(STATM, "rb") as statm:
        return int(statm.read().split()[1]) * PAGE_BYTES


class HeapWatch:
    """`check()` between bands: trims the heap when resident memory grew past the slack.
    Made by `watch_for`, which makes none without glibc."""

    def __init__(self, slack_bytes: int = TRIM_SLACK_BYTES):
        self.slack_bytes = slack_bytes
        self.mark = resident_bytes()
        self.trims = 0

    def check(self) -> None:
        if resident_bytes() - self.mark > self.slack_bytes:
            MALLOC_TRIM(0)
            self.trims += 1
            self.mark = resident_bytes()  # what is still resident is live: grow from there


def untrimmed_growth(pass_bytes: int) -> int:
    """The most a pass over `pass_bytes` of block entries grows the heap before any trim: about
    one chunk of temporaries left in a hole per chunk."""
    return 2 * pass_bytes


def watch_for(pair_bytes: int) -> HeapWatch | None:
    """A watch for a pass over `pair_bytes` of block entries, or None when the heap cannot grow
    past the slack: small requests read nothing."""
    return None if MALLOC_TRIM is None or untrimmed_growth(pair_bytes) <= TRIM_SLACK_BYTES else HeapWatch()
