"""gunicorn settings for blockgrad (the README explains each choice).

Workers x torch threads never exceed the cores, so workers do not fight over them.
"""
import glob
import os
import shutil
import tempfile

cores = os.cpu_count() or 1

bind = os.environ.get("BLOCKGRAD_BIND", "127.0.0.1:8000")
workers = int(os.environ.get("WEB_CONCURRENCY", min(2, cores)))
worker_class = "sync"
torch_threads = max(1, cores // workers)

# No preload_app: the app (and torch's CUDA state) must be created after fork.
preload_app = False
timeout = 120  # above BLOCKGRAD_REQUEST_TIMEOUT_S, which stops a request first
graceful_timeout = 30
max_requests = 1000  # recycle workers against slow memory growth
max_requests_jitter = 100
worker_tmp_dir = "/dev/shm" if os.path.isdir("/dev/shm") else None
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
    for stale in glob.glob(os.path.join(path, "*.db")):
        os.remove(stale)


def child_exit(server, worker):
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)  # drop its live gauges (in-flight requests, device)


def on_exit(server):
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if created_metrics_dir:
        shutil.rmtree(created_metrics_dir, ignore_errors=True)
    elif path:
        for stale in glob.glob(os.path.join(path, "*.db")):
            os.remove(stale)


def post_fork(server, worker):
    import torch

    torch.set_num_threads(torch_threads)
