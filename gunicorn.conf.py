"""gunicorn settings for blockgrad (the README explains each choice).

Workers x torch threads never exceed the cores, so workers do not fight over them.
"""
import os

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
accesslog = None
errorlog = "-"


def post_fork(server, worker):
    import torch

    torch.set_num_threads(torch_threads)
