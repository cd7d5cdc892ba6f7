"""Workers recycled against slow memory growth (allocator fragmentation), one at a time.

A worker at max_requests stops accepting, drains, exits, and only then does the master fork
its replacement. So that the others keep serving meanwhile, a worker drains only while it
holds the RecyclePermit, which a loading worker holds too until it is ready to serve: a
worker whose turn comes while a sibling holds it serves POSTPONE_REQUESTS more and asks again.
"""
import fcntl
import math

MIN_MAX_REQUESTS = 100
MIN_JITTER_SHARE = 0.1  # so that workers started together do not restart together
POSTPONE_REQUESTS = 10
LOCK_NAME = "recycle.lock"


def enforce_floor(cfg, log) -> None:
    """max_requests and its jitter as gunicorn will use them (gunicorn.conf.py, GUNICORN_CMD_ARGS
    or the command line), raised to at least MIN_MAX_REQUESTS and MIN_JITTER_SHARE of it."""
    requests, jitter = cfg.max_requests, cfg.max_requests_jitter
    if requests <= 0:
        return  # recycling off
    if requests < MIN_MAX_REQUESTS:
        log.warning("max_requests %d raised to %d: workers would restart too often", requests, MIN_MAX_REQUESTS)
        requests = MIN_MAX_REQUESTS
        cfg.set("max_requests", requests)
    floor = math.ceil(MIN_JITTER_SHARE * requests)
    if jitter < floor:
        log.warning("max_requests_jitter %d raised to %d (10%% of max_requests) so workers restart apart",
                    jitter, floor)
        cfg.set("max_requests_jitter", floor)


class RecyclePermit:
    """An exclusive flock on a file all workers open: held by the one loading or draining.

    Each worker opens the file itself after fork: flock locks belong to an open file, so a
    sibling's open would not share this one's lock, and the lock goes when the worker does."""

    def __init__(self, path: str):
        self._file = open(path, "a+")
        self.held = False

    def take(self) -> bool:
        if not self.held:
            try:
                fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self.held = True
            except BlockingIOError:
                pass
        return self.held

    def give_back(self) -> None:
        if self.held:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self.held = False


class WorkerRecycling:
    """One worker's part in recycling: it loads holding the permit, then recycles only with it."""

    def __init__(self, permit: RecyclePermit):
        self.permit = permit
        self.draining = False

    @classmethod
    def loading(cls, lock_path: str) -> "WorkerRecycling":
        recycling = cls(RecyclePermit(lock_path))
        recycling.permit.take()  # not had if a sibling is draining: it then loads all the same
        return recycling

    def loaded(self) -> None:
        if not self.draining:
            self.permit.give_back()

    def before_request(self, worker) -> None:
        """Before gunicorn counts this request: if it is the worker's last, drain (holding the
        permit until exit) when no sibling holds it, else move the last request on."""
        if self.draining or worker.nr + 1 < worker.max_requests:
            return
        if self.permit.take():
            self.draining = True
            worker.log.info("worker %s recycles after %d requests", worker.pid, worker.nr + 1)
        else:
            worker.max_requests = worker.nr + 1 + POSTPONE_REQUESTS
