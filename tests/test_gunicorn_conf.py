"""gunicorn.conf.py: the settings the docs describe, read as gunicorn reads them, and the warm
start it relies on (app/serving)."""
import os
import runpy
from pathlib import Path

import pytest

from app.core.settings import Settings, available_cores
from app.serving.settings import ServingSettings
from app.serving.warmup import warm_start

CONF = Path(__file__).resolve().parent.parent / "gunicorn.conf.py"


def load(monkeypatch, **env):
    for name in ("WEB_CONCURRENCY", "BLOCKGRAD_REQUEST_TIMEOUT_S", "BLOCKGRAD_BIND"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return runpy.run_path(str(CONF))


def test_defaults(monkeypatch):
    conf = load(monkeypatch)
    cores = available_cores()  # the cgroup quota or affinity mask, not os.cpu_count()
    assert conf["bind"] == "127.0.0.1:8000"
    assert conf["preload_app"] is False  # no CUDA state may cross fork
    assert conf["workers"] == min(2, cores)
    assert conf["workers"] * conf["torch_threads"] <= max(cores, conf["workers"])
    assert conf["timeout"] >= 2 * 60  # the 60 s deadline answers long before gunicorn kills
    assert conf["graceful_timeout"] > 60  # a request may use its whole deadline during shutdown
    assert conf["max_requests"] > 0 and 0 < conf["max_requests_jitter"] < conf["max_requests"]
    if os.path.isdir("/dev/shm"):
        assert conf["worker_tmp_dir"] == "/dev/shm"


@pytest.mark.parametrize("deadline,timeout,graceful", [("5", 120, 15), ("200", 400, 210), ("0.5", 120, 11)])
def test_timeouts_follow_the_deadline(monkeypatch, deadline, timeout, graceful):
    conf = load(monkeypatch, BLOCKGRAD_REQUEST_TIMEOUT_S=deadline)
    assert (conf["timeout"], conf["graceful_timeout"]) == (timeout, graceful)


def test_web_concurrency_is_honoured(monkeypatch):
    conf = load(monkeypatch, WEB_CONCURRENCY="3")
    assert conf["workers"] == 3
    assert conf["torch_threads"] == 1  # one per computing thread: a request spreads over the pod's slots


def test_bind_is_honoured(monkeypatch):
    assert load(monkeypatch, BLOCKGRAD_BIND="0.0.0.0:9123")["bind"] == "0.0.0.0:9123"


def test_settings_read_bind_and_workers_under_their_names():
    settings = ServingSettings.from_env({"BLOCKGRAD_BIND": "[::1]:9000", "WEB_CONCURRENCY": "3", "BLOCKGRAD_WORKERS": "7"})
    assert (settings.bind, settings.workers) == ("[::1]:9000", 3)
    assert ServingSettings.from_env({}).workers == min(2, available_cores())


def test_the_config_reads_no_environment_variable_itself():
    """Every variable goes through Settings, which names it when its value is bad."""
    source = CONF.read_text()
    assert "environ" not in source and "getenv" not in source


def test_the_master_does_not_import_torch(monkeypatch):
    """preload_app is off and the config itself must not pull torch into the master."""
    import subprocess
    import sys
    code = f"import runpy, sys; runpy.run_path({str(CONF)!r}); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("cpu_max,quota_cores", [("max 100000", None), ("200000 100000", 2),
                                                 ("150000 100000", 1), ("50000 100000", 1), ("garbage", None)])
def test_cores_follow_the_cgroup_cpu_quota(monkeypatch, tmp_path, cpu_max, quota_cores):
    path = tmp_path / "cpu.max"
    path.write_text(cpu_max + "\n")
    affinity = len(os.sched_getaffinity(0))
    expected = affinity if quota_cores is None else min(affinity, quota_cores)
    assert available_cores(str(path)) == expected
    assert available_cores(str(tmp_path / "missing")) == affinity


@pytest.mark.parametrize("value,workers", [("", None), ("  ", None), ("1", 1), ("4", 4)])
def test_web_concurrency_blank_means_the_default(monkeypatch, value, workers):
    conf = load(monkeypatch, WEB_CONCURRENCY=value)
    assert conf["workers"] == (workers or min(2, available_cores()))


@pytest.mark.parametrize("name,value", [("WEB_CONCURRENCY", "0"), ("WEB_CONCURRENCY", "-2"), ("WEB_CONCURRENCY", "two"),
                                        ("BLOCKGRAD_REQUEST_TIMEOUT_S", "0"), ("BLOCKGRAD_REQUEST_TIMEOUT_S", "soon")])
def test_bad_values_stop_the_start_with_the_variables_name(monkeypatch, name, value):
    with pytest.raises(ValueError, match=name):
        load(monkeypatch, **{name: value})


def test_worker_model(monkeypatch):
    """gthread: threads above the compute slots (a worker's requests may hold every core of the
    pod) + queue + spare; keep-alive from the settings."""
    assert load(monkeypatch)["keepalive"] == 75
    conf = load(monkeypatch, BLOCKGRAD_QUEUE_DEPTH="5", BLOCKGRAD_KEEPALIVE_S="80")
    assert conf["worker_class"] == "app.serving.worker.ConnectionWorker"  # gthread, heads read in its poller
    assert conf["threads"] == available_cores() + 5 + conf["SPARE_THREADS"] and conf["SPARE_THREADS"] >= 16 + 4
    assert conf["keepalive"] == 80
    assert conf["max_requests"] >= 100 and conf["max_requests_jitter"] >= conf["max_requests"] // 10


@pytest.mark.parametrize("device,warm", [("cpu", True), ("cuda", False), ("cuda:1", False)])
def test_warm_start_only_on_cpu(device, warm):
    assert warm_start(device) is warm
