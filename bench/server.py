"""Start the service with gunicorn exactly as `make serve` does, on a free loopback port.

Same command (gunicorn -c gunicorn.conf.py wsgi:app), same config file; only
BLOCKGRAD_BIND differs. The process is always stopped on exit (context manager).
"""
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 120
STOP_TIMEOUT_S = 30


def gunicorn_settings() -> dict:
    """gunicorn.conf.py's values (workers, torch_threads) as the server will see them."""
    return runpy.run_path(str(ROOT / "gunicorn.conf.py"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def gunicorn_command() -> list[str]:
    script = Path(sys.executable).parent / "gunicorn"  # .venv/bin/gunicorn, as in `make serve`
    if script.exists():
        return [str(script), "-c", "gunicorn.conf.py", "wsgi:app"]
    return [sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py", "wsgi:app"]


def child_pids(parent: int) -> list[int]:
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue  # exited meanwhile
            # Fields after the ")" that ends the command name: state, ppid, ...
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                children.append(int(entry.name))
    return sorted(children)


def peak_rss_bytes(pid: int) -> int:
    """VmHWM: the most resident memory the process has had."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


class Server:
    """`with Server() as server:` gunicorn on 127.0.0.1:<free port>, ready to answer."""

    def __init__(self):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workers = int(gunicorn_settings()["workers"])
        self.process: subprocess.Popen | None = None
        self.log = tempfile.TemporaryFile()

    def __enter__(self) -> "Server":
        env = dict(os.environ, BLOCKGRAD_BIND=f"127.0.0.1:{self.port}")
        self.process = subprocess.Popen(gunicorn_command(), cwd=ROOT, env=env,
                                        stdout=self.log, stderr=subprocess.STDOUT)
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"gunicorn exited with {self.process.returncode}:\n{self.log_tail()}")
            if len(self.worker_pids()) == self.workers and self.answers("/readyz"):
                # Every worker imports the app at boot; give each time to finish before measuring.
                for _ in range(4 * self.workers):
                    self.answers("/readyz")
                return
            time.sleep(0.2)
        raise RuntimeError(f"gunicorn not ready after {START_TIMEOUT_S} s:\n{self.log_tail()}")

    def answers(self, path: str) -> bool:
        try:
            return requests.get(self.url + path, timeout=10).status_code == 200
        except requests.RequestException:
            return False

    def worker_pids(self) -> list[int]:
        return child_pids(self.process.pid)

    def worker_peak_rss(self) -> int:
        """The largest VmHWM among the workers: the one that served the request."""
        return max(peak_rss_bytes(pid) for pid in self.worker_pids())

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        workers = self.worker_pids()
        self.process.send_signal(signal.SIGTERM)  # gunicorn's graceful stop
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(STOP_TIMEOUT_S)
            for pid in workers:  # orphaned by the kill
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def log_tail(self, size: int = 4000) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-size:]
