"""The job runner and the embedded cluster under the real gunicorn command: the master spawns
a supervisor of the runner, a Dask scheduler and niced workers as plain subprocesses; the
first POST after the start is accepted; everything dies with the master even when the master
is SIGKILLed, and a new service on the same BLOCKGRAD_DATA_DIR finishes the job that was
running, exact; a stop hands a running job back to the store."""
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import requests
import torch
from blockgrad_client import BlockgradError, Client

from app.jobs import db
from tests.dask_cluster import HeldTiles, close_clients, dask_role
from tests.numeric import assert_matches
from tools.reference import reference_accumulated
from tools.server import children, gunicorn_server, wait_until

JOB_S = 120  # bounded: the cluster starts (workers import torch) while gunicorn does
pytestmark = pytest.mark.slow


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


def all_children(pid: int) -> list[int]:
    """Children of every thread of `pid` (a nanny starts its worker process from a thread)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found += [int(child) for child in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def listening_hosts(pid: int) -> set[str]:
    """The IPv4 addresses `pid` listens on, from /proc (Linux)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    hosts = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
            host = int(fields[1].split(":")[0], 16)
            hosts.add(".".join(str(host >> shift & 255) for shift in (0, 8, 16, 24)))
    return hosts


def test_gunicorn_runs_jobs_which_a_restart_after_a_sigkill_of_everything_finishes(tmp_path):
    env = {"BLOCKGRAD_DASK_SCHEDULER": "", "BLOCKGRAD_DASK_WORKERS": "1", "BLOCKGRAD_DATA_DIR": str(tmp_path / "data"),
           "BLOCKGRAD_JOB_LEASE_S": "3"}
    vectors = np.random.default_rng(1).standard_normal((30, 3))
    body = {"vectors": vectors.tolist(), "factor": 4, "dtype": "float64"}
    expected = reference_accumulated(torch.tensor(vectors), 4, "sum").numpy()
    with gunicorn_server(workers=2, env=env) as server:
        first = requests.post(server.url + "/v1/jobs", json=body, timeout=30)  # as soon as /healthz answers
        assert first.status_code == 202, first.text
        [supervisor] = [pid for pid in children(server.pid) if " -m app.jobs.supervisor " in cmdline(pid)]
        address = f"tls://127.0.0.1:{cmdline(supervisor).split(' -m app.jobs.supervisor ')[1].split()[0]}"
        # Three children, each past its exec: a child forked a moment ago still shows the supervisor's
        # command line (its preexec_fn runs first), not the one it is started with.
        def started_as() -> list[str]:
            return sorted("runner" if " -m app.jobs.runner " in cmdline(pid) else str(dask_role(cmdline(pid)))
                          for pid in children(supervisor))
        assert wait_until(lambda: started_as() == ["runner", "scheduler", "worker"], JOB_S, 0.2), started_as()
        dask = [pid for pid in children(supervisor) if dask_role(cmdline(pid))]
        roles = sorted(dask_role(cmdline(pid)) for pid in dask)
        assert roles == ["scheduler", "worker"], [cmdline(pid) for pid in dask]
        [job_runner] = [pid for pid in children(supervisor) if " -m app.jobs.runner " in cmdline(pid)]
        assert cmdline(job_runner).split()[-1] == address  # the only Client of the service, of this cluster
        for pid in dask:  # as started; a process distributed has retitled shows only its role and address
            line = cmdline(pid)
            assert "127.0.0.1" in line and (" -m dask " not in line or "--no-dashboard" in line), line
        worker = next(pid for pid in dask if dask_role(cmdline(pid)) == "worker")  # the nanny
        assert nice(worker) == 19
        # The cluster in a session of its own (the supervisor's): a signal to the server's process
        # group reaches only the master, which stops it in order; PDEATHSIG ties it to the master.
        assert os.getsid(supervisor) == supervisor != os.getsid(server.pid)
        assert os.getpgid(worker) == os.getpgid(supervisor) == os.getpgid(job_runner)
        def spawned():  # the worker process the nanny runs (and restarts), beside multiprocessing's tracker
            return [pid for pid in all_children(worker)
                    if "spawn_main" in cmdline(pid) or dask_role(cmdline(pid)) == "worker"]
        assert wait_until(spawned, JOB_S, 0.5)
        inner = all_children(worker)
        assert "torch" not in Path(f"/proc/{worker}/maps").read_text()  # only the worker process loads it
        assert all(nice(pid) == 19 and os.getpgid(pid) == os.getpgid(supervisor) for pid in inner)
        everything = dask + inner + [supervisor, job_runner]  # they die with the master too
        for pid in dask:  # Dask's processes serve HTTP (health, metrics) even without a dashboard
            assert listening_hosts(pid) <= {"127.0.0.1"}, (cmdline(pid), listening_hosts(pid))
        location = server.url + first.headers["Location"]

        def succeeded():  # fresh connections: any worker answers, all see the job
            answer = requests.get(location, timeout=30)
            return answer.status_code == 200 and answer.json()["status"] == "succeeded"
        assert wait_until(succeeded, JOB_S, 0.3)
        accumulated = requests.get(location + "/result", timeout=30).json()["accumulated"]
        assert_matches(accumulated, expected, "float64", what="accumulated")
        check_the_client_package(server.url, vectors, expected, HeldTiles(address, tmp_path / "held"))
        held = HeldTiles(address, tmp_path / "held-at-kill").__enter__()  # never left: the cluster dies holding it
        running = requests.post(server.url + "/v1/jobs", json={**body, "factor": 3}, timeout=30)
        assert running.status_code == 202, running.text
        held.wait_started(running.json()["id"])  # its tiles held: running when everything is SIGKILLed
        log = server.log()  # before the kill: a worker that outlives its scheduler by a moment logs its loss
        for event in ("job_submitted", "job_cancelled", "job_deleted"):  # the gunicorn workers' JSON lines
            assert f'"message":"{event}"' in log, event
        assert "Traceback" not in log  # the first job was posted while the workers were still joining
        finished = [line for line in log.splitlines() if '"event": "job_finished"' in line]  # the runner's
        assert finished and '"stored": true' in finished[0] and '"bytes_moved"' in finished[0]
        os.kill(server.pid, signal.SIGKILL)
        assert wait_until(lambda: not any(alive(pid) for pid in everything), 30, 0.2)
        close_clients(address)  # this process's, which held the tiles
    with gunicorn_server(workers=2, env=env) as server:  # the same store, a new cluster
        again = requests.post(server.url + "/v1/jobs", json=body, timeout=30)  # as soon as /healthz answers
        assert again.status_code == 202, again.text
        for created, factor in ((again.json(), 4), (running.json(), 3)):
            location = f"{server.url}/v1/jobs/{created['id']}"
            assert wait_until(lambda: requests.get(location, timeout=30).json()["status"] == "succeeded", JOB_S, 0.3)
            result = requests.get(location + "/result", timeout=30).json()
            assert_matches(result["accumulated"], reference_accumulated(torch.tensor(vectors), factor, "sum").numpy(),
                           "float64", what=f"accumulated, factor {factor}")
        assert requests.get(location, timeout=30).json()["attempts"] == 2  # the killed service's attempt counted
        [supervisor] = [pid for pid in children(server.pid) if " -m app.jobs.supervisor " in cmdline(pid)]
        address = f"tls://127.0.0.1:{cmdline(supervisor).split(' -m app.jobs.supervisor ')[1].split()[0]}"
        held = HeldTiles(address, tmp_path / "held-at-stop").__enter__()  # never left: the cluster stops holding it
        stopped = requests.post(server.url + "/v1/jobs", json={**body, "factor": 2}, timeout=30).json()
        held.wait_started(stopped["id"])
        close_clients(address)
        # A stop (SIGTERM, as tools/server.py sends it): the supervisor stops the runner first, which
        # hands its job back to the store, queued, its attempt not spent. Waited for here: the whole
        # stop outlasts tools/server.py's 10 s before its SIGKILL (seen: handed back at 3 s, killed at 10).
        store = db.open_store(f"sqlite:///{tmp_path}/data/jobs.sqlite3")
        os.killpg(server.pid, signal.SIGTERM)
        assert wait_until(lambda: db.get_job(store, stopped["id"])["status"] != "running", JOB_S, 0.2), \
            db.get_job(store, stopped["id"])
    row = db.get_job(store, stopped["id"])
    assert (row["status"], row["attempts"], row["owner"]) == ("queued", 0, None), row


def check_the_client_package(url: str, vectors: np.ndarray, expected: np.ndarray, held: HeldTiles) -> None:
    with Client(url) as client:
        job = client.submit_job(vectors, factor=4, dtype="float64", idempotency_key="client-once")
        assert client.submit_job(vectors, factor=4, dtype="float64", idempotency_key="client-once").id == job.id
        assert job.status() in ("queued", "running", "succeeded")
        record = job.wait(timeout=JOB_S, progress=True)
        assert record["status"] == "succeeded" and record["progress"]["blocks_done"] == 16
        result = job.result()
        assert set(result) == {"accumulated", "losses", "bounds"} and result["accumulated"].dtype == np.float64
        assert_matches(result["accumulated"], expected, "float64", what="the client's accumulated")
        with pytest.raises(BlockgradError) as done:
            job.cancel()
        assert done.value.code == "job_done"
        job.delete()
        with pytest.raises(BlockgradError) as missing:
            job.status()
        assert missing.value.code == "job_not_found"
        with held:  # its tiles held at their start: running, not done, when asked
            long = client.submit_job(np.ones((64, 4)), factor=8, objective="sum_of_squares", outputs=["losses"])
            held.wait_started(long.id)
            assert long.status() == "running"
            with pytest.raises(BlockgradError) as early:
                long.result()
            assert early.value.code == "job_not_done"
            assert long.cancel()["status"] == "cancelled"
