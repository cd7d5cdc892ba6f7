"""gunicorn's server hooks, named in gunicorn.conf.py; each hands its work to one module here.

The master loads this module: nothing at module level imports torch, Flask or
prometheus-client (the library picks its multiprocess mode on first import, which must come
after on_starting has set PROMETHEUS_MULTIPROC_DIR).
"""
import logging
import os
import signal
import sys
from dataclasses import dataclass

from gunicorn import systemd

import app.tracing as tracing
from app.core import host
from app.core.settings import Settings, available_cores
from app.jobs import cluster as dask_cluster
from app.jobs.settings import JobSettings

from . import addresses, grpc_server, metrics_archive, slots, tuning, warmup
from .metrics_dir import MetricsDir
from .settings import ServingSettings, check_auth

# A kept-alive connection stays with the worker that accepted it: after a recycle, one worker
# can end up with every busy connection. Closing each after this many requests (as nginx's
# keepalive_requests does) lets the accept race, which the least busy worker wins, spread them.
KEEPALIVE_REQUESTS = 100


@dataclass
class Process:
    """What the hooks keep. on_starting fills it in the master; every worker inherits it at fork."""
    settings: Settings | None = None
    metrics: MetricsDir | None = None
    cluster: dask_cluster.EmbeddedCluster | None = None  # the job runner and embedded Dask cluster (docs/jobs.md)
    serving: ServingSettings | None = None
    grpc: grpc_server.Running | None = None  # the worker's own, after the fork


process = Process()


def on_starting(server):
    """Before any worker exists: refuse a public bind without a token and a taken address,
    prepare the metrics directory, create the pod's compute slots,
    and on CPU load the app (gunicorn's own load of wsgi:app, kept for the workers)."""
    # By name: the token is the HTTP layer's setting, and serving does not import that layer.
    process.serving, token = ServingSettings.from_env(), os.environ.get("BLOCKGRAD_API_TOKEN")
    check_auth(server.cfg.address, process.serving, token, server.log)
    inherited = server.LISTENERS or server.master_pid or systemd.listen_fds(unset_environment=False)
    if not inherited:  # a re-exec'd master's or systemd's sockets are ours already
        addresses.refuse_if_taken(server.cfg.address, server.cfg.reuse_port)
        grpc_server.check_address(process.serving, server.cfg.address, token, server.log)
    process.settings = Settings.from_env()
    process.metrics = MetricsDir.prepare(server.cfg.worker_tmp_dir)
    host.scrape_lock = metrics_archive.scrape_lock(process.metrics.path)  # scrapes lock it against folds
    # Before the app is built (below, or in each worker after fork): every worker shares them.
    host.slots = slots.create(available_cores(), parent=server.cfg.worker_tmp_dir)
    # Before the app is built: the workers' settings carry the data directory, made absolute.
    process.cluster = dask_cluster.start_for_gunicorn(JobSettings.from_env())
    if warmup.warm_start(process.settings.device):
        server.app.wsgi()  # no torch op runs here
    process.metrics.empty()  # the master's own (empty) value files: it never serves


def post_fork(server, worker):
    process.metrics.prepare_worker_files(worker.pid)  # before any value is written
    tuning.tune_worker()


def post_worker_init(worker):
    """Loaded: warm the engine up, then serve gRPC, before accepting HTTP. SIGTERM starts the
    gRPC drain at once, beside HTTP's (gunicorn's own handler runs after ours)."""
    tracing.configure()  # after the fork: the exporter's thread is this worker's (off: nothing)
    if (failed := warmup.warm_up(process.settings)) is not None:
        worker.log.warning("warm-up computation failed (the worker starts; /readyz reports the device): %s", failed)
    process.grpc = grpc_server.start(process.serving or ServingSettings.from_env(), worker.cfg.threads,
                                     worker.cfg.graceful_timeout)
    if process.grpc is not None:
        gunicorns = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, lambda signum, frame: (process.grpc.drain(), gunicorns(signum, frame)))


def pre_request(worker, req):
    if KEEPALIVE_REQUESTS and getattr(req, "req_number", 0) >= KEEPALIVE_REQUESTS:
        req.must_close = True  # gunicorn then answers "Connection: close"


def worker_exit(server, worker):
    """A worker recycled at max_requests (gunicorn's own) has answered its last request:
    leave at once. The interpreter's own shutdown with torch loaded takes hundreds of ms, all
    before the master can fork the replacement. Nothing needs it: the request log is flushed
    here, metric values live in shared files, no request is in flight. Any other exit (a
    stop, a signal) takes the ordinary path. Either way gRPC's calls in flight finish first."""
    if process.grpc is not None:
        process.grpc.wait()
    if not 0 < worker.max_requests <= worker.nr:
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def worker_abort(worker):
    """gunicorn killed this worker past `timeout` (SIGABRT, handled in the worker just before
    it exits): log each request it still held as worker_timeout, not as the client_closed its
    body's close would otherwise report."""
    host.on_abort()


def child_exit(server, worker):
    """In the master, the worker reaped: its counts join the archive, its files go."""
    if process.metrics is not None:
        metrics_archive.fold_dead_workers(process.metrics.path, set(server.WORKERS))


def on_exit(server):
    dask_cluster.stop_embedded(process.cluster)
    if process.metrics is not None:
        process.metrics.remove()
    if host.slots is not None:
        slots.remove(host.slots)
