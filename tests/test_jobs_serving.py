"""The embedded cluster under the real gunicorn command: the master spawns a Dask scheduler
and niced workers as plain subprocesses, every gunicorn worker reaches it, and the cluster
dies with the master even when the master is SIGKILLed."""
import os
import signal
import time
from pathlib import Path

import numpy as np
import requests
import torch

from tools.reference import reference_accumulated
from tools.server import children, gunicorn_server, wait_until

JOB_S = 120  # bounded: the cluster starts (workers import torch) while gunicorn does


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def nice(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_gunicorn_runs_jobs_on_its_embedded_cluster_which_dies_with_the_master():
    env = {"BLOCKGRAD_DASK_SCHEDULER": "", "BLOCKGRAD_DASK_WORKERS": "1"}
    with gunicorn_server(workers=2, env=env) as server:
        dask = [pid for pid in children(server.pid) if " -m dask " in cmdline(pid)]
        roles = sorted(cmdline(pid).split(" -m dask ")[1].split()[0] for pid in dask)
        assert roles == ["scheduler", "worker"], [cmdline(pid) for pid in dask]
        assert all("--no-dashboard" in cmdline(pid) and "127.0.0.1" in cmdline(pid) for pid in dask)
        worker = next(pid for pid in dask if " worker " in cmdline(pid))
        assert nice(worker) == 19
        assert os.getpgid(worker) == os.getpgid(server.pid)  # in the master's process group
        vectors = np.random.default_rng(1).standard_normal((30, 3))
        created = requests.post(server.url + "/v1/jobs", json={"vectors": vectors.tolist(), "factor": 4,
                                                               "dtype": "float64"}, timeout=30)
        assert created.status_code == 202, created.text
        location = server.url + created.headers["Location"]

        def succeeded():  # fresh connections: any worker answers, all see the job
            return requests.get(location, timeout=30).json()["status"] == "succeeded"
        assert wait_until(succeeded, JOB_S, 0.3)
        accumulated = requests.get(location + "/result", timeout=30).json()["accumulated"]
        expected = reference_accumulated(torch.tensor(vectors), 4, "sum").numpy()
        assert np.abs(np.array(accumulated) - expected).max() <= 1e-12 * np.abs(expected).max()
        os.kill(server.pid, signal.SIGKILL)
        assert wait_until(lambda: not any(alive(pid) for pid in dask), 30, 0.2)
