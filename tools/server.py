"""Start and stop a real gunicorn: the one launcher for the tests and the benchmark.

Loopback only, a free port, bounded waits; the same command and config file as
`make serve` (gunicorn -c gunicorn.conf.py wsgi:app), only BLOCKGRAD_BIND differs.

    with gunicorn_server(workers=2, env={"BLOCKGRAD_REQUEST_TIMEOUT_S": "2"}) as server:
        requests.get(server.url + "/healthz", timeout=5)
        server.worker_pids()

`workers=None` and `device=None` leave both to gunicorn.conf.py and the app's config,
as `make serve` does (the benchmark). The context manager kills the whole process
group in `finally`, whatever happens.
"""
import contextlib
import os
import runpy
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
START_TIMEOUT_S = 120  # importing torch in each worker on a busy 2-core machine


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def gunicorn_settings() -> dict:
    """gunicorn.conf.py's values (workers, torch_threads) as a server started from this environment sees them."""
    return runpy.run_path(str(ROOT / "gunicorn.conf.py"))


def gunicorn_command(app: str = "wsgi:app") -> list[str]:
    """`make serve`'s command: .venv/bin/gunicorn beside this Python, else the module."""
    script = Path(sys.executable).parent / "gunicorn"
    launcher = [str(script)] if script.exists() else [sys.executable, "-m", "gunicorn"]
    return [*launcher, "-c", "gunicorn.conf.py", app]


def children(pid: int) -> list[int]:
    """Direct children of `pid`, read from /proc (Linux)."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    try:
        return [int(p) for p in path.read_text().split()]
    except (FileNotFoundError, ProcessLookupError):
        return []


def is_dask_process(pid: int) -> bool:
    """The embedded cluster's supervisor or one of its Dask processes."""
    try:
        line = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return False
    return b" -m dask " in line or b" -m app.jobs.supervisor " in line


def status_kib(pid: int, field: str) -> int:
    """A memory field of /proc/<pid>/status, in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise ValueError(f"no {field} for {pid}")


def rss_kib(pid: int) -> int:
    return status_kib(pid, "VmRSS")


def peak_rss_kib(pid: int) -> int:
    """VmHWM: the most resident memory the process has had."""
    return status_kib(pid, "VmHWM")


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
    grpc_port: int | None = None  # BLOCKGRAD_GRPC_BIND's, on 127.0.0.1

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def worker_pids(self) -> list[int]:
        """gunicorn's workers: the master's children but the embedded Dask cluster's."""
        return [pid for pid in children(self.pid) if not is_dask_process(pid)]

    def worker_peak_rss_bytes(self) -> int:
        """The largest VmHWM among the workers: the one that served the biggest request."""
        return 1024 * max(peak_rss_kib(pid) for pid in self.worker_pids())

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def answers(self, path: str) -> bool:
        try:
            return requests.get(self.url + path, timeout=10).status_code == 200
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

    def wait_ready(self, path: str, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until `path` answers 200 and all workers are up; fails at once if gunicorn exits."""
        def ready_or_exited():
            return self.process.poll() is not None or (self.answers(path) and len(self.worker_pids()) == self.workers)
        ready = wait_until(ready_or_exited, timeout_s, 0.2)
        if self.process.poll() is not None:
            raise RuntimeError(f"gunicorn exited with {self.process.returncode}:\n{self.log()[-4000:]}")
        if not ready:
            raise RuntimeError(f"gunicorn not ready within {timeout_s} s:\n{self.log()[-4000:]}")


@contextlib.contextmanager
def gunicorn_server(workers: int | None = 2, env: dict[str, str] | None = None, *,
                    device: str | None = "cpu", ready_path: str = "/healthz", app: str = "wsgi:app"):
    """gunicorn on 127.0.0.1:<free port>, ready when `ready_path` answers and every worker is up.

    workers: WEB_CONCURRENCY, or None for gunicorn.conf.py's default. device:
    BLOCKGRAD_DEVICE, or None for the app's default. env: more variables, set last (e.g.
    GUNICORN_CMD_ARGS="--worker-class sync"). app: the WSGI app (the benchmark's no-op floor).
    """
    port = free_port()
    # No embedded Dask cluster unless a test asks for one (docs/jobs.md): two more processes
    # importing torch would slow every server start on a small machine.
    grpc_port = free_port()  # gRPC beside HTTP, as `make serve` starts it (a test may set BLOCKGRAD_GRPC_BIND)
    full_env = {"BLOCKGRAD_DASK_SCHEDULER": "off", **os.environ, "BLOCKGRAD_BIND": f"127.0.0.1:{port}",
                "BLOCKGRAD_GRPC_BIND": f"127.0.0.1:{grpc_port}"}
    if workers is not None:
        full_env["WEB_CONCURRENCY"] = str(workers)
    if device is not None:
        full_env["BLOCKGRAD_DEVICE"] = device
    full_env.update(env or {})
    expected_workers = workers if workers is not None else int(gunicorn_settings()["workers"])
    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(tmp) / "gunicorn.log"
        with open(log_path, "wb") as log_file:
            process = subprocess.Popen(  # a job store of its own, unless a test shares one between servers
                gunicorn_command(app), cwd=ROOT, env={"BLOCKGRAD_DATA_DIR": f"{tmp}/data", **full_env}, stdout=log_file, stderr=subprocess.STDOUT,
                start_new_session=True)  # its own process group, so teardown reaches the workers
        try:
            grpc_on = full_env["BLOCKGRAD_GRPC_BIND"] == f"127.0.0.1:{grpc_port}"
            server = Server(process, port, expected_workers, log_path, grpc_port if grpc_on else None)
            server.wait_ready(ready_path)
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
