"""A worker process's own settings, applied after fork: torch threads, one malloc arena and a
short GIL switch interval."""
import sys

from app.core.heap import M_ARENA_MAX, mallopt

# One per computing thread, whatever the workers: a request spreads over the pod's free
# compute slots (one per core, app/serving/slots.py), each chunk on a thread of its own, so
# more torch threads per chunk would oversubscribe the cores the slots stand for.
TORCH_THREADS = 1


def tune_worker() -> None:
    import torch  # in the worker only: the master must stay free of it

    torch.set_num_threads(TORCH_THREADS)
    # glibc gives each new thread its own malloc arena (up to 8 per core): with a pool of
    # threads parsing bodies, every arena would grow to a large request's size and the worker's
    # memory with them. One is enough: a worker computes on few lanes, and torch's own work does
    # not allocate per element. Not glibc: nothing happens.
    mallopt(M_ARENA_MAX, 1)
    # A thread waiting for the GIL (the main loop handing over a connection, a probe) waits
    # for the running thread's switch interval: 5 ms by default; 1 ms here.
    sys.setswitchinterval(0.001)
