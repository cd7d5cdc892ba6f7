"""gunicorn settings for blockgrad; the hooks are app/serving's (docs/serving.md).

Loads neither torch nor Flask: the master stays free of CUDA state (app/serving/warmup.py
says when the master imports the app before forking).
"""
import math
import os

from app.core.settings import Settings, available_cores
from app.serving import addresses, tuning
from app.serving.settings import ServingSettings
from app.serving.hooks import (child_exit, on_exit, on_starting, post_fork,  # noqa: F401
                               post_worker_init, pre_request, worker_abort, worker_exit)

settings = Settings.from_env()  # raises at start-up, naming the variable, on a bad value
serving = ServingSettings.from_env()

bind = serving.bind  # BLOCKGRAD_BIND
workers = serving.workers  # WEB_CONCURRENCY
torch_threads = tuning.TORCH_THREADS  # 1: each compute slot is one core (docs/cores.md)
cores = available_cores()  # the pod's compute slots, shared by its workers (app/serving/slots.py)

# Threads take connections, probes and slow clients; a request computes on one of the pod's
# compute slots (app/core/slots.py), BLOCKGRAD_QUEUE_DEPTH waiting per worker.
worker_class = "app.serving.worker.ConnectionWorker"  # gthread, connections waiting in its poller (docs/connections.md)
# Threads neither computing nor queued: 16 slow uploads (each freed after at most
# BLOCKGRAD_READ_TIMEOUT_S), slow readers (BLOCKGRAD_SEND_TIMEOUT_S), probes, /metrics, docs.
SPARE_THREADS = 24
threads = cores + settings.queue_depth + SPARE_THREADS  # a worker's requests may hold every slot of the pod
# Idle connections kept past a balancer's usual 60 s idle timeout: the balancer closes them.
keepalive = math.ceil(serving.keepalive_s)
worker_connections = serving.max_connections  # per worker (the worker class reads the setting)

# gthread's timeout watches only the worker's main loop, never a request thread: the request
# deadline and the read and send timeouts end stuck requests instead.
timeout = max(120, math.ceil(2 * settings.request_timeout_s))
graceful_timeout = math.ceil(settings.request_timeout_s) + 10  # SIGTERM: a whole deadline, then margin
# Recycled by gunicorn, apart thanks to the jitter, as a backstop against a leak (an operator's
# model): a worker's memory does not grow with requests (docs/serving.md), and each restart
# costs its clients throughput, so rarely.
max_requests = 20000
max_requests_jitter = 2000

preload_app = False  # on CPU on_starting has gunicorn load wsgi:app, after the metrics directory and the slots exist
worker_tmp_dir = "/dev/shm" if os.path.isdir("/dev/shm") else None  # heartbeat off disk
control_socket = addresses.control_socket_path()  # gunicornc's, one per instance
accesslog = None  # the app writes one JSON line per request (app/http/record.py)
errorlog = "-"  # stderr, like the app's log
