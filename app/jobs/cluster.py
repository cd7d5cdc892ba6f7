"""The job runner and the embedded Dask cluster: `dask scheduler` and `dask worker` processes
on 127.0.0.1.

Standard library only (cryptography for the TLS credentials, imported when they are made):
gunicorn's master calls `start_for_gunicorn` from on_starting and
`stop_embedded` from on_exit, and must create no Dask object and no thread (it forks
workers at every recycle), so the runner and the cluster are plain subprocesses under one
supervisor process (app/jobs/supervisor.py) that starts again whichever of them exits. They run in a
session of their own (a signal to the server's process group does not reach them; the
supervisor stops them in order) and get SIGKILL from the kernel when their parent dies, SIGKILL
included (PR_SET_PDEATHSIG): a niced worker's graceful shutdown can take long on a busy
machine, and a dead master's jobs are gone anyway. Each `dask worker` is a nanny that
restarts its worker process when it dies (the worker process exits when its nanny does).
Workers run at nice 19, so that job tasks yield the CPU to synchronous requests. The runner
(app/jobs/runner.py) holds the service's only Client, to the address on its command line;
gunicorn's workers never talk to Dask. The cluster speaks TLS only, with credentials made at each
start (app/jobs/tls.py) and given to the supervisor alone, which hands them to its children as
Dask configuration: nothing else can connect to it.
"""
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from .settings import OFF, JobSettings

DASK = [sys.executable, "-m", "dask"]  # `dask` with this interpreter, whatever the PATH
ROOT = Path(__file__).resolve().parent.parent.parent  # the repository: tasks import app.core there
DATA_DIR_ENV = "BLOCKGRAD_DATA_DIR"
WORKER_NICE = 19
PR_SET_PDEATHSIG = 1
STOP_TIMEOUT_S = 10
# What a nanny sets before it starts its worker: distributed's defaults (one thread for the
# numeric libraries) less MALLOC_TRIM_THRESHOLD_, which would make every chunk tensor a fresh
# mmap (tasks.restore_malloc_reuse; None unsets a default). As Dask configuration, given in
# the environment: deploy/k8s/dask/workers.yaml sets the same.
NANNY_ENVIRON = '{"MALLOC_TRIM_THRESHOLD_": None, "OMP_NUM_THREADS": 1, "MKL_NUM_THREADS": 1, "OPENBLAS_NUM_THREADS": 1}'
# Without a dashboard each process still serves HTTP, on loopback like the rest, and with its
# health route alone: the others show task keys (job ids), logs and addresses (docs/jobs.md).
LOOPBACK_ANY_PORT = "127.0.0.1:0"
HEALTH_ONLY = '["distributed.http.health"]'
# A job's vectors are scattered to every worker so that a worker's death loses no input; the
# Active Memory Manager would drop those copies whenever fewer of the job's tiles wait on them
# than there are workers (between the scatter and the graph, at a job's end). As Dask
# configuration, given in the environment: deploy/k8s/dask/scheduler.yaml sets the same.
SCHEDULER_CONFIG = {"DASK_DISTRIBUTED__SCHEDULER__ACTIVE_MEMORY_MANAGER__START": "False",
                    "DASK_DISTRIBUTED__SCHEDULER__HTTP__ROUTES": HEALTH_ONLY}
# An idle cluster's upkeep (docs/jobs.md, "Idle"): no profiler for a dashboard no one is shown,
# event loops checked once a second (a 3 s stall is still logged), statistics every 5 s.
IDLE_CONFIG = {"DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED": "False", "DASK_DISTRIBUTED__ADMIN__TICK__INTERVAL": "1s",
               "DASK_DISTRIBUTED__ADMIN__SYSTEM_MONITOR__INTERVAL": "5s"}


@dataclass
class EmbeddedCluster:
    address: str
    processes: list[subprocess.Popen] = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent(nice: int = 0):
    """preexec_fn: SIGKILL when the parent dies (Linux), then lower the priority."""
    def setup():
        with suppress(OSError, AttributeError):  # not Linux: stop_embedded stops them on a clean exit
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if nice:
            os.nice(nice)
    return setup


def cluster_env() -> dict[str, str]:
    """This environment over the cluster's defaults: one core per task (the tasks also set
    torch's threads); distributed.batched quiet, since a stop closes the workers before the
    scheduler and a message it was sending one would end in an INFO line with a traceback;
    IDLE_CONFIG."""
    env = {"OMP_NUM_THREADS": "1", "DASK_LOGGING": '{"distributed.batched": "warning"}', **IDLE_CONFIG, **os.environ}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def start_scheduler(port: int) -> subprocess.Popen:
    """A `dask scheduler` on tls://127.0.0.1:port (a fresh one, at the same address, after a restart)."""
    return subprocess.Popen([*DASK, "scheduler", "--protocol", "tls", "--host", "127.0.0.1", "--port", str(port),
                             "--no-dashboard", "--dashboard-address", LOOPBACK_ANY_PORT],
                            env={**cluster_env(), **SCHEDULER_CONFIG}, cwd=ROOT, stdin=subprocess.DEVNULL,
                            preexec_fn=die_with_parent())


def start_worker(address: str, memory_limit: str) -> subprocess.Popen:
    """A single-threaded `dask worker` under its nanny, niced, joining `address`."""
    # torch loaded before the first job, by the worker process only: `--preload` would have the
    # nanny's command line import it too (to check its arguments; docs/jobs.md, "Memory").
    env = {**cluster_env(), "DASK_DISTRIBUTED__WORKER__PRELOAD": '["app.core.job_tasks"]',
           "DASK_DISTRIBUTED__NANNY__PRE_SPAWN_ENVIRON": NANNY_ENVIRON,
           "DASK_DISTRIBUTED__WORKER__HTTP__ROUTES": HEALTH_ONLY}
    return subprocess.Popen(
        [*DASK, "worker", address, "--host", "127.0.0.1", "--nthreads", "1",
         "--no-dashboard", "--dashboard-address", LOOPBACK_ANY_PORT, "--memory-limit", memory_limit],
        env=env, cwd=ROOT, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent(WORKER_NICE))


def start_runner(address: str | None) -> subprocess.Popen:
    """`python -m app.jobs.runner`, of `address` (None: BLOCKGRAD_DASK_SCHEDULER's)."""
    return subprocess.Popen([sys.executable, "-m", "app.jobs.runner", *([address] if address else [])],
                            env=cluster_env(), cwd=ROOT, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent())


def stop_processes(processes: list[subprocess.Popen], timeout_s: float) -> None:
    """SIGTERM every process (the last first), then SIGKILL what is left after timeout_s."""
    for process in reversed(processes):
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + timeout_s
    for process in processes:
        try:
            process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


def start_embedded(workers: int, memory_limit: str = "auto", runner: bool = True,
                   embedded: bool = True) -> EmbeddedCluster:
    """Spawn the supervisor (app/jobs/supervisor.py) of a scheduler, `workers` nannied workers
    and (`runner`) the job runner; returns at once (workers join within seconds). Not
    `embedded`: the runner alone, of BLOCKGRAD_DASK_SCHEDULER's cluster (TLS as the environment's
    Dask configuration says)."""
    port = free_port() if embedded else 0
    tls = {}
    if embedded:
        from .tls import credentials  # here: cryptography only where a cluster starts

        tls = credentials()
    # A session of its own: a signal to the server's process group (Ctrl-C) reaches only the
    # supervisor's parent, and the supervisor stops the rest in order (a nanny's worker
    # killed by the group's signal instead leaks its semaphores).
    supervisor = subprocess.Popen([sys.executable, "-m", "app.jobs.supervisor", str(port), str(workers), memory_limit,
                                   str(int(runner))], env={**cluster_env(), **tls}, cwd=ROOT, stdin=subprocess.DEVNULL,
                                  preexec_fn=die_with_parent(), start_new_session=True)
    return EmbeddedCluster(f"tls://127.0.0.1:{port}", [supervisor])


def stop_embedded(cluster: EmbeddedCluster | None, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Stop the supervisor, which stops the rest (SIGKILL after timeout_s; its children then die with it)."""
    if cluster is not None:
        stop_processes(cluster.processes, timeout_s + 5)


def start_for_gunicorn(settings: JobSettings) -> EmbeddedCluster | None:
    """on_starting: with BLOCKGRAD_DASK_SCHEDULER unset, the embedded cluster and its runner; set
    to an address, the runner alone; `off`, nothing. The data directory is exported absolute:
    the runner runs in the repository, and gunicorn's workers must open the same store."""
    if settings.dask_scheduler == OFF:
        return None
    os.environ[DATA_DIR_ENV] = settings.data_dir
    return start_embedded(settings.dask_workers, embedded=not settings.dask_scheduler)
