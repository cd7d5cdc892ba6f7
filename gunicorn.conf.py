"""gunicorn settings for blockgrad (the README explains each choice).

Workers x torch threads never exceed the cores, so workers do not fight over them.
This file must not import torch (only app.core.settings, standard library): the master stays
free of CUDA state; on CPU only, on_starting imports the app (and torch) before the fork.
"""
import ctypes
import fcntl
import glob
import logging
import math
import os
import shutil
import sys
import tempfile

from app.core.settings import COMPUTE_SLOTS, Settings, available_cores, env_int  # standard library only: no torch here
from app.jobs.cluster import start_for_gunicorn, stop_embedded  # subprocesses only: no Dask object in the master

cores = available_cores()
settings = Settings.from_env()  # raises at start-up, with the variable's name, on a bad value

bind = os.environ.get("BLOCKGRAD_BIND", "127.0.0.1:8000")
workers = env_int("WEB_CONCURRENCY", min(2, cores))  # blank: the default; at least 1
torch_threads = max(1, cores // workers)  # each worker computes on the cores it owns

# Worker model (README, "Worker model"): threads take connections, probes and slow clients;
# one computation at a time per worker (app/core/gate.py) with BLOCKGRAD_QUEUE_DEPTH waiting.
worker_class = "gthread"
# Threads that are neither computing nor queued: 16 slow uploads (each freed after at most
# BLOCKGRAD_READ_TIMEOUT_S), slow readers (BLOCKGRAD_SEND_TIMEOUT_S), probes, /metrics, docs.
SPARE_THREADS = 24
threads = COMPUTE_SLOTS + settings.queue_depth + SPARE_THREADS
# Idle connections kept past a balancer's usual 60 s idle timeout: the balancer closes them.
keepalive = math.ceil(settings.keepalive_s)
worker_connections = 1000  # open connections per worker, idle keep-alive ones included
# A kept-alive connection stays with the worker that accepted it. When a worker recycles, its
# clients reconnect to the siblings, so one worker can end up with every busy connection while
# its fresh replacement idles. Closing each connection after this many requests (as nginx's
# keepalive_requests and Envoy's max_requests_per_connection do) lets the accept race, which
# the least busy worker wins, spread them again; 0 turns it off.
KEEPALIVE_REQUESTS = 100

# gthread's timeout watches only the worker's main loop (its heartbeat), never a request
# thread: the request deadline, the read and the send timeouts end stuck requests instead.
request_timeout_s = settings.request_timeout_s
timeout = max(120, math.ceil(2 * request_timeout_s))
# On SIGTERM a worker finishes its requests first: allow a whole deadline plus margin.
graceful_timeout = math.ceil(request_timeout_s) + 10
# Recycle workers against slow memory growth (allocator fragmentation). A worker at
# max_requests stops accepting, drains, exits, and only then is its replacement forked:
# on_starting keeps max_requests >= 100 with >= 10% jitter, and pre_request lets one
# worker at a time drain (a file lock), so the others keep serving.
max_requests = 1000
max_requests_jitter = 200
MIN_MAX_REQUESTS = 100
MIN_JITTER_SHARE = 0.1
RECYCLE_POSTPONE = 10  # requests a worker serves on when a sibling is draining or loading

# Loading torch and the app in the master before forking makes a restarted worker ready in
# milliseconds instead of seconds. Safe on CPU only: a CUDA context must never cross fork,
# so with a GPU (or one that may be there) each worker still imports after fork.
warm_start = settings.device == "cpu" or (settings.device == "auto" and not os.path.exists("/dev/nvidiactl"))
preload_app = False  # the master imports the app in on_starting instead, after setting the metrics directory
worker_tmp_dir = "/dev/shm" if os.path.isdir("/dev/shm") else None  # heartbeat off disk
# gunicorn's control socket (gunicornc): one per instance, named by the master's pid, so that
# instances on one machine never share one, nor remove another's when they stop.
control_socket = os.path.join(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir(),
                              f"blockgrad-gunicorn-{os.getpid()}.ctl")
accesslog = None  # the app writes one JSON line per request instead (app/http/request_log.py)
errorlog = "-"  # stderr, like the app's log
created_metrics_dir = None  # set when on_starting made a temporary PROMETHEUS_MULTIPROC_DIR
recycle_lock_path = None  # set by on_starting; the lock a draining or loading worker holds
embedded_cluster = None  # set by on_starting when BLOCKGRAD_DASK_SCHEDULER is unset (docs/jobs.md)


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
    enforce_recycling_floor(server.cfg, server.log)
    global recycle_lock_path
    recycle_lock_path = os.path.join(path, "recycle.lock")
    global embedded_cluster
    # Before the app is imported: its settings (and the workers') carry the cluster's address.
    embedded_cluster = start_for_gunicorn(settings.dask_workers)
    if warm_start:
        # PROMETHEUS_MULTIPROC_DIR is set above, before the app (and prometheus-client) is
        # imported; workers find `wsgi` in sys.modules after fork. No torch op runs here.
        import wsgi  # noqa: F401

        remove_metric_files(path)  # the master's own (empty) value files: it never serves


def enforce_recycling_floor(cfg, log) -> None:
    """max_requests and its jitter as gunicorn will use them (this file, GUNICORN_CMD_ARGS or
    the command line), raised to at least 100 and 10%: restarts spread out."""
    requests, jitter = cfg.max_requests, cfg.max_requests_jitter
    if requests <= 0:
        return  # recycling off
    if requests < MIN_MAX_REQUESTS:
        log.warning("max_requests %d raised to %d: workers would restart too often", requests, MIN_MAX_REQUESTS)
        requests = MIN_MAX_REQUESTS
        cfg.set("max_requests", requests)
    floor = math.ceil(MIN_JITTER_SHARE * requests)
    if jitter < floor:
        log.warning("max_requests_jitter %d raised to %d (10%% of max_requests) so workers restart apart",
                    jitter, floor)
        cfg.set("max_requests_jitter", floor)


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
    stop_embedded(embedded_cluster)
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
    limit_malloc_arenas()
    # A thread waiting for the GIL (the main loop handing over a connection, a probe) waits
    # for the running thread's switch interval: 5 ms by default, 1 ms here.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    # Its own open file (flock locks belong to it): held while this worker loads, so that a
    # sibling does not start draining while this one cannot serve yet.
    worker.recycle_lock = open(recycle_lock_path, "a+") if recycle_lock_path else None
    worker.loading_lock = try_lock(worker.recycle_lock)
    worker.draining = False


SWITCH_INTERVAL_S = 0.001
MALLOC_ARENAS = 1
M_ARENA_MAX = -8  # glibc's mallopt parameter


def limit_malloc_arenas() -> None:
    """glibc gives each new thread its own malloc arena (up to 8 per core): with a pool of
    threads parsing bodies, every arena would grow to a large request's size and the
    worker's memory with them (two arenas still showed a +12% step in the soak test). One is
    enough: one computation at a time, and torch's own work does not allocate per element.
    Not glibc: skip."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(M_ARENA_MAX, MALLOC_ARENAS)
    except (OSError, AttributeError):
        pass


def post_worker_init(worker):
    """Loaded: warm the engine up before accepting (still holding the loading lock, so that
    no sibling starts draining meanwhile), then let siblings recycle."""
    from app.core.run import warm_up

    failed = warm_up(settings)
    if failed is not None:
        worker.log.warning("warm-up computation failed (the worker starts; /readyz reports the device): %s", failed)
    if getattr(worker, "loading_lock", False):
        fcntl.flock(worker.recycle_lock, fcntl.LOCK_UN)
        worker.loading_lock = False


def worker_exit(server, worker):
    """A recycled worker has served its last request: leave at once. The interpreter's own
    shutdown with torch loaded takes about 400 ms, all of it before the master can fork the
    replacement (and while this worker holds the recycle lock). Nothing needs it: the request
    log is flushed here, metric values live in shared mmap files, no request is in flight."""
    if not getattr(worker, "draining", False):
        return  # any other exit (SIGTERM, a failure) takes the ordinary path
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def try_lock(lock_file) -> bool:
    if lock_file is None:
        return True
    try:
        fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def pre_request(worker, req):
    """Before gunicorn counts this request: close its connection after the answer if it is
    the connection's KEEPALIVE_REQUESTS-th; if it is the worker's last, recycle only when no
    sibling is draining or loading (this worker then holds the lock until it exits);
    otherwise serve a few more first."""
    if KEEPALIVE_REQUESTS and getattr(req, "req_number", 0) >= KEEPALIVE_REQUESTS:
        req.must_close = True  # gunicorn then answers "Connection: close"
    if worker.draining or worker.nr + 1 < worker.max_requests:
        return
    if try_lock(getattr(worker, "recycle_lock", None)):
        worker.draining = True
        worker.log.info("worker %s recycles after %d requests", worker.pid, worker.nr + 1)
    else:
        worker.max_requests = worker.nr + 1 + RECYCLE_POSTPONE
