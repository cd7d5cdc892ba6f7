"""`python -m app.jobs.supervisor PORT WORKERS MEMORY_LIMIT RUNNER`: keeps the job runner and
the embedded cluster up.

gunicorn's master may start no thread and reaps every child of its own (it forks workers
at every recycle), so it spawns this one process and leaves the rest to it: the job runner
(`python -m app.jobs.runner`, RUNNER 1) and, PORT not 0, a `dask scheduler` on
tls://127.0.0.1:PORT and WORKERS nannied `dask worker`s, all of them with the TLS credentials
in this process's environment (cluster.start_embedded's); each is started again when it exits (a
scheduler at the same address: the runner's Client reconnects to it; the workers it lost
with the old one rejoin). Restarts of one process are spaced out, so a process that cannot
start does not spin. On SIGTERM it stops the runner (which hands its jobs back), the
workers, then the scheduler, and exits. Its children get SIGKILL when it dies, and it when
the master dies (cluster.die_with_parent), so nothing outlives the service.
"""
import signal
import subprocess
import sys
import time

from .cluster import STOP_TIMEOUT_S, start_runner, start_scheduler, start_worker, stop_processes

POLL_S = 0.5
FIRST_BACKOFF_S = 1.0
MOST_BACKOFF_S = 30.0
# A process that ran this long before it exited was healthy: its next restart is immediate.
HEALTHY_RUN_S = 60.0


class Supervised:
    """One process kept running: `start` again after each exit, later each time it fails fast."""

    def __init__(self, name: str, start):
        self.name, self._start = name, start
        self.process: subprocess.Popen | None = None
        self.started_at = self.backoff = self.next_start = 0.0

    def back_off(self, now: float, healthy: bool = False) -> None:
        """The next start: at once after a healthy run, else after twice the last wait (bounded)."""
        self.backoff = 0.0 if healthy else min(MOST_BACKOFF_S, max(FIRST_BACKOFF_S, 2 * self.backoff))
        self.next_start = now + self.backoff

    def check(self, now: float) -> None:
        if self.process is not None and self.process.poll() is None:
            return
        if self.process is not None:  # it exited: when may it start again?
            ran = now - self.started_at
            self.back_off(now, healthy=ran >= HEALTHY_RUN_S)
            print(f"blockgrad supervisor: {self.name} exited ({self.process.returncode}) after {ran:.1f} s; "
                  f"starting it again in {self.backoff:.1f} s", file=sys.stderr, flush=True)
            self.process = None
        if now >= self.next_start:
            try:
                self.process, self.started_at = self._start(), now
            except OSError as exc:  # could not even spawn it (no memory, no file descriptors): later
                self.back_off(now)
                print(f"blockgrad supervisor: cannot start {self.name} ({exc}); trying again in "
                      f"{self.backoff:.1f} s", file=sys.stderr, flush=True)


def supervise(port: int, workers: int, memory_limit: str, runner: bool) -> None:
    address = f"tls://127.0.0.1:{port}" if port else None  # None: the runner's is BLOCKGRAD_DASK_SCHEDULER
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(True))
    groups = [[Supervised("job runner", lambda: start_runner(address))] if runner else [],
              [Supervised(f"worker {k}", lambda: start_worker(address, memory_limit))
               for k in range(workers if port else 0)],
              [Supervised("scheduler", lambda: start_scheduler(port))] if port else []]
    try:
        while not stopping:
            now = time.monotonic()
            for member in reversed(sum(groups, [])):  # the scheduler first
                member.check(now)
            time.sleep(POLL_S)
    finally:  # the runner (it hands its jobs back), the workers, then their scheduler (a worker
        # that loses it mid-close logs tracebacks)
        for group in groups:
            stop_processes([m.process for m in group if m.process is not None], STOP_TIMEOUT_S)


if __name__ == "__main__":
    supervise(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1")
