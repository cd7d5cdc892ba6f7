"""app/serving: what the master may import, and a taken BLOCKGRAD_BIND
(against a real gunicorn, which must exit at once with one line naming the variable)."""
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from app.serving import addresses
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
