"""gunicorn settings for blockgrad (the README explains each choice).

Workers x torch threads never exceed the cores, so workers do not fight over them.
This file must not import torch (only app.core.settings, standard library): the master stays free of CUDA state.
"""
import glob
import math
import os
import shutil
import tempfile

from app.core.settings import Settings, env_int  # standard library only: no torch in the master


def available_cores(cpu_max: str = "/sys/fs/cgroup/cpu.max") -> int:
    """Cores this process may use: the cgroup CPU quota in a container (rounded down), else
    the affinity mask. os.cpu_count() alone would see the whole node from inside a pod."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open(cpu_max) as f:  # cgroup v2: "<quota> <period>" or "max <period>"
            quota, period = f.read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.floor(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)


cores = available_cores()
settings = Settings.from_env()  # raises at start-up, with the variable's name, on a bad value

bind = os.environ.get("BLOCKGRAD_BIND", "127.0.0.1:8000")
workers = env_int("WEB_CONCURRENCY", min(2, cores))  # blank: the default; at least 1
worker_class = "sync"
torch_threads = max(1, cores // workers)

# No preload_app: the app, torch and any CUDA context are created in each worker after
# fork; a CUDA context inherited across fork is unusable.
preload_app = False
# The request deadline (checked between blocks) answers 503 long before gunicorn would
# kill the worker; keep gunicorn's timeout at least twice the deadline.
request_timeout_s = settings.request_timeout_s
timeout = max(120, math.ceil(2 * request_timeout_s))
# On SIGTERM a worker finishes its request first: allow a whole deadline plus margin.
graceful_timeout = math.ceil(request_timeout_s) + 10
max_requests = 1000  # recycle workers against slow memory growth (allocator fragmentation)
max_requests_jitter = 100  # so the workers do not all restart at once
worker_tmp_dir = "/dev/shm" if os.path.isdir("/dev/shm") else None  # heartbeat off disk
# gunicorn's control socket (gunicornc): one per instance, named by the master's pid, so that
# instances on one machine never share one, nor remove another's when they stop.
control_socket = os.path.join(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir(),
                              f"blockgrad-gunicorn-{os.getpid()}.ctl")
accesslog = None  # the app writes one JSON line per request instead (app/request_log.py)
errorlog = "-"  # stderr, like the app's log
created_metrics_dir = None  # set when on_starting made a temporary PROMETHEUS_MULTIPROC_DIR


def on_starting(server):
    """A fresh, empty directory for prometheus-client's multiprocess mode, before any worker exists.

    Every worker inherits PROMETHEUS_MULTIPROC_DIR and keeps its metric values in files
    there, so that /metrics, whichever worker answers it, adds up all workers. Files left
    from an earlier run would be added too, hence emptied.
    """
    global created_metrics_dir
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not path:
        path = created_metrics_dir = tempfile.mkdtemp(prefix="blockgrad-metrics-", dir=worker_tmp_dir)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    os.makedirs(path, exist_ok=True)
    remove_metric_files(path)


def child_exit(server, worker):
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)  # drop its live gauges (in-flight requests, device)


def worker_abort(worker):
    """gunicorn killed this worker past `timeout` (SIGABRT, handled in the worker just before it
    exits): log each request it still held as worker_timeout, not as the client_closed its
    body's close would otherwise report."""
    try:
        from app.http import observe
    except Exception:  # the app never loaded in this worker: nothing in flight to log
        return
    observe.abort_in_flight(observe.WORKER_TIMEOUT)


def on_exit(server):
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if created_metrics_dir:
        shutil.rmtree(created_metrics_dir, ignore_errors=True)
    elif path:
        remove_metric_files(path)


def remove_metric_files(path):
    for stale in glob.glob(os.path.join(path, "*.db")):
        os.remove(stale)


def post_fork(server, worker):
    import torch

    torch.set_num_threads(torch_threads)
