"""app/serving: what the master may import, the recycle permit, and a taken BLOCKGRAD_BIND
(against a real gunicorn, which must exit at once with one line naming the variable)."""
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from app.serving import addresses
from app.serving.recycling import POSTPONE_REQUESTS, RecyclePermit, WorkerRecycling
from tools.server import ROOT, free_port, gunicorn_command

SERVING = ROOT / "app" / "serving"


# connection_metrics is the worker's, imported only after fork (worker.py's own entry checks that).
POST_FORK_ONLY = {"__init__", "connection_metrics"}


@pytest.mark.parametrize("module", sorted(p.stem for p in SERVING.glob("*.py") if p.stem not in POST_FORK_ONLY))
def test_serving_modules_load_neither_torch_flask_nor_prometheus_client(module):
    """gunicorn's master loads them (the config file, the worker class). prometheus-client picks
    its multiprocess mode when first imported: before on_starting sets PROMETHEUS_MULTIPROC_DIR,
    every worker forked from a warm master would keep its values in memory, and /metrics,
    which reads the files, would miss them."""
    code = (f"import sys; import app.serving.{module}; "
            "print(sorted(m for m in ('torch', 'flask', 'numpy', 'prometheus_client') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_config_file_loads_no_prometheus_client():
    code = ("import runpy, sys; runpy.run_path('gunicorn.conf.py'); "
            "print('prometheus_client' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_one_permit_at_a_time(tmp_path):
    """Each worker opens the lock file itself: two opens of it exclude each other like two workers."""
    path = str(tmp_path / "recycle.lock")
    first, second = RecyclePermit(path), RecyclePermit(path)
    assert first.take() and first.take()  # taking one's own again holds it
    assert not second.take() and not second.held
    first.give_back()
    assert second.take() and not first.take()


class FakeLog:
    def __init__(self):
        self.lines = []

    def info(self, message, *args):
        self.lines.append(message % args)


class FakeWorker:
    def __init__(self, nr, max_requests):
        self.nr, self.max_requests, self.pid, self.log = nr, max_requests, 4321, FakeLog()


def test_a_worker_loads_holding_the_permit_and_drains_only_with_it(tmp_path):
    path = str(tmp_path / "recycle.lock")
    loading = WorkerRecycling.loading(path)
    sibling = WorkerRecycling(RecyclePermit(path))
    last = FakeWorker(nr=99, max_requests=100)
    sibling.before_request(last)  # its last request while the other still loads: postponed
    assert not sibling.draining and last.max_requests == 100 + POSTPONE_REQUESTS
    loading.loaded()
    early = FakeWorker(nr=50, max_requests=last.max_requests)
    sibling.before_request(early)
    assert not sibling.draining and not sibling.permit.held  # not its last request yet
    last.nr = last.max_requests - 1
    sibling.before_request(last)
    assert sibling.draining and sibling.permit.held
    assert last.log.lines == [f"worker 4321 recycles after {last.max_requests} requests"]
    assert not loading.permit.take()  # held until the draining worker exits
    sibling.loaded()  # a draining worker keeps it
    assert sibling.permit.held


def test_a_taken_address_is_found_a_free_one_is_not():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert addresses.taken([("127.0.0.1", port)]) == f"127.0.0.1:{port}"
        assert addresses.taken(["/tmp/some.sock", 5, ("127.0.0.1", port)]) == f"127.0.0.1:{port}"
    assert addresses.taken([("127.0.0.1", free_port())]) is None


@pytest.mark.slow
def test_a_taken_bind_stops_gunicorn_at_once_naming_blockgrad_bind():
    """gunicorn alone retries five times a second apart and then says "Can't connect"."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        env = {**os.environ, "BLOCKGRAD_BIND": f"127.0.0.1:{port}", "BLOCKGRAD_DEVICE": "cpu"}
        out = subprocess.run(gunicorn_command(), cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    log = out.stdout + out.stderr
    assert out.returncode == 1, log
    [line] = [line for line in log.splitlines() if "BLOCKGRAD_BIND" in line]
    assert f"127.0.0.1:{port}" in line and "already in use" in line
    assert "Retrying" not in log and "Connection in use" not in log and "Booting worker" not in log


def test_the_control_socket_is_named_by_the_masters_pid():
    assert Path(addresses.control_socket_path()).name == f"blockgrad-gunicorn-{os.getpid()}.ctl"


def test_warm_up_computes_on_cpu_and_reports_a_device_it_cannot_use():
    from app.core.settings import Settings
    from app.serving.warmup import warm_up

    assert warm_up(Settings(device="cpu")) is None
    assert isinstance(warm_up(Settings(device="tpu")), Exception)  # returned, not raised: the worker starts
