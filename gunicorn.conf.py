"""gunicorn settings for blockgrad (the README explains each choice).

Workers x torch threads never exceed the cores, so workers do not fight over them.
This file must not import torch or the app: the master stays free of CUDA state.
"""
import math
import os

cores = os.cpu_count() or 1

bind = os.environ.get("BLOCKGRAD_BIND", "127.0.0.1:8000")
workers = int(os.environ.get("WEB_CONCURRENCY", min(2, cores)))  # WEB_CONCURRENCY honoured
worker_class = "sync"
torch_threads = max(1, cores // workers)

# No preload_app: the app, torch and any CUDA context are created in each worker after
# fork; a CUDA context inherited across fork is unusable.
preload_app = False
# The request deadline (checked between blocks) answers 503 long before gunicorn would
# kill the worker; keep gunicorn's timeout at least twice the deadline.
request_timeout_s = float(os.environ.get("BLOCKGRAD_REQUEST_TIMEOUT_S") or 60)
timeout = max(120, math.ceil(2 * request_timeout_s))
# On SIGTERM a worker finishes its request first: allow a whole deadline plus margin.
graceful_timeout = math.ceil(request_timeout_s) + 10
max_requests = 1000  # recycle workers against slow memory growth (allocator fragmentation)
max_requests_jitter = 100  # so the workers do not all restart at once
worker_tmp_dir = "/dev/shm" if os.path.isdir("/dev/shm") else None  # heartbeat off disk
accesslog = None
errorlog = "-"


def post_fork(server, worker):
    import torch

    torch.set_num_threads(torch_threads)
