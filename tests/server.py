"""Start and stop a real gunicorn for tests: loopback only, free port, bounded waits.

    with gunicorn_server(workers=2, env={"BLOCKGRAD_REQUEST_TIMEOUT_S": "2"}) as server:
        requests.get(server.url + "/healthz", timeout=5)
        server.worker_pids()

The context manager kills the whole process group in `finally`, whatever happens.
"""
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 60  # importing torch in each worker on a busy 2-core machine


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def children(pid: int) -> list[int]:
    """Direct children of `pid`, read from /proc (Linux)."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    try:
        return [int(p) for p in path.read_text().split()]
    except (FileNotFoundError, ProcessLookupError):
        return []


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise ValueError(f"no VmRSS for {pid}")


def cpu_ticks(pid: int) -> int:
    """User + system CPU time of `pid` in clock ticks (/proc/<pid>/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def wait_until(predicate, timeout_s: float, interval_s: float = 0.1) -> bool:
    """Poll `predicate` until it is true or `timeout_s` passes; bounded."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())


@dataclass
class Server:
    process: subprocess.Popen
    port: int
    workers: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def worker_pids(self) -> list[int]:
        return children(self.pid)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def healthy(self) -> bool:
        try:
            return requests.get(self.url + "/healthz", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def busy_worker(self, timeout_s: float = 20, window_s: float = 0.3) -> int | None:
        """The worker that is burning CPU (serving a long request), or None."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            pids = self.worker_pids()
            try:
                before = {pid: cpu_ticks(pid) for pid in pids}
                time.sleep(window_s)
                used = {pid: cpu_ticks(pid) - ticks for pid, ticks in before.items()}
            except (FileNotFoundError, ProcessLookupError):
                continue
            busy = [pid for pid, ticks in used.items() if ticks >= 5]  # 100 Hz ticks: >= 50 ms of CPU
            if len(busy) == 1:
                return busy[0]
        return None

    def wait_for_workers(self, count: int, timeout_s: float = START_TIMEOUT_S) -> bool:
        return wait_until(lambda: len(self.worker_pids()) == count, timeout_s)


@contextlib.contextmanager
def gunicorn_server(workers: int = 2, env: dict[str, str] | None = None):
    port = free_port()
    full_env = {**os.environ, "WEB_CONCURRENCY": str(workers), "BLOCKGRAD_BIND": f"127.0.0.1:{port}",
                "BLOCKGRAD_DEVICE": "cpu", **(env or {})}
    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(tmp) / "gunicorn.log"
        with open(log_path, "wb") as log_file:
            process = subprocess.Popen(
                [sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py", "wsgi:app"],
                cwd=ROOT, env=full_env, stdout=log_file, stderr=subprocess.STDOUT,
                start_new_session=True)  # its own process group, so teardown reaches the workers
        server = Server(process, port, workers, log_path)
        try:
            if not (wait_until(server.healthy, START_TIMEOUT_S, 0.2) and server.wait_for_workers(workers)):
                raise RuntimeError(f"gunicorn did not start within {START_TIMEOUT_S} s:\n{server.log()}")
            yield server
        finally:
            stop(process)


def stop(process: subprocess.Popen, timeout_s: float = 10) -> None:
    """SIGTERM the group, then SIGKILL it if it has not gone within `timeout_s`."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # stragglers: workers left behind
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout_s)
