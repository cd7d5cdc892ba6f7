"""Where a small request's CPU time goes, stage by stage, in this process (docs/small-requests.md).

    python -m bench.stages [--served]

Each stage is called back to back and timed with this thread's CPU clock (time.thread_time),
the median of a few batches: the machine's other load moves it little. The WSGI rows call the
apps as gunicorn would (environ in, iterate the body, close), without the server; --served
adds the servers' own share, the workers' CPU per request of a no-op WSGI app under each
app's gunicorn settings (gthread as `make serve` runs it, sync as the peer's), from /proc.
"""
import argparse
import io
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

# As under gunicorn: metric values in memory-mapped files (set before prometheus_client loads).
os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", tempfile.mkdtemp(prefix="bench-stages-metrics-"))
os.environ.setdefault("BLOCKGRAD_DEVICE", "cpu")

import flask  # noqa: E402
import orjson  # noqa: E402
import torch  # noqa: E402
from werkzeug.test import EnvironBuilder  # noqa: E402

from app import create_app  # noqa: E402
from app.http.record import JsonStderrHandler  # noqa: E402

from tools.server import gunicorn_settings  # noqa: E402

from . import peer  # noqa: E402
from .small_requests import BODY  # noqa: E402

BATCH = 200
BATCHES = 5


def cpu_ms(fn: Callable[[], object], batch: int = BATCH, batches: int = BATCHES) -> float:
    """Median CPU milliseconds of one call of `fn` (this thread), over `batches` batches."""
    fn()  # warm-up
    per_call = []
    for _ in range(batches):
        start = time.thread_time()
        for _ in range(batch):
            fn()
        per_call.append((time.thread_time() - start) / batch)
    return 1e3 * statistics.median(per_call)


def wsgi_call(app, method: str, path: str, body: bytes = b"") -> Callable[[], int]:
    """A call of `app` as a WSGI server makes it: a fresh environ and input, the body iterated, closed."""
    template = EnvironBuilder(path=path, method=method, data=body,
                              content_type="application/json" if body else None).get_environ()

    def call() -> int:
        environ = dict(template, **{"wsgi.input": io.BytesIO(body)})
        statuses = []
        answer = app(environ, lambda status, headers, exc_info=None: statuses.append(status))
        try:
            size = sum(len(piece) for piece in answer)
        finally:
            getattr(answer, "close", lambda: None)()
        if not statuses[0].startswith("200"):
            raise RuntimeError(f"{method} {path}: {statuses[0]}")
        return size

    return call


def bare_flask() -> flask.Flask:
    """The least a Flask JSON view costs: get_json and a small jsonify."""
    bare = flask.Flask("bare")

    @bare.post("/echo")
    def echo():
        flask.request.get_json()
        return flask.jsonify(ok=True)

    return bare


class Stopwatch:
    """Wraps functions where the request path looks them up (module attributes, Flask's hook
    lists) and adds up this thread's CPU time inside each, by stage (several functions may make
    one stage); a function absent after a refactor is reported as such, not guessed."""

    def __init__(self):
        self.spent: dict[str, float] = {}  # stage -> CPU seconds, in the order stages were added
        self.top_level: dict[str, bool] = {}  # stage -> not inside another timed stage
        self.missing: list[str] = []

    def wrap(self, stage: str, fn: Callable, top_level: bool) -> Callable:
        self.spent.setdefault(stage, 0.0)
        self.top_level[stage] = top_level

        def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[stage] += time.thread_time() - start

        return timed

    def patch(self, stage: str, owner, attribute: str, top_level: bool = True) -> None:
        if not hasattr(owner, attribute):
            self.missing.append(f"{stage}: {getattr(owner, '__name__', owner)}.{attribute}")
            return
        setattr(owner, attribute, self.wrap(stage, getattr(owner, attribute), top_level))

    def patch_hooks(self, stage: str, hooks: list, only: Callable | None = None) -> None:
        """Every function of a Flask hook list (or only `only`)."""
        for k, hook in enumerate(list(hooks)):
            if only is None or hook is only:
                hooks[k] = self.wrap(stage, hook, True)
        if only is not None and self.spent.get(stage) is None:
            self.missing.append(f"{stage}: {only.__qualname__} among the hooks")

    def reset(self) -> None:
        self.spent = dict.fromkeys(self.spent, 0.0)


def instrument(service: flask.Flask) -> Stopwatch:
    """The service's request path for POST /v1/gradients, stage by stage, in the order it runs."""
    from app.api.v1 import gradients
    from app.core import slots
    from app.http import body, pipeline, record

    watch = Stopwatch()
    watch.patch_hooks("before_request hooks (request record: ids, timing, in-flight; auth)",
                      service.before_request_funcs.setdefault(None, []))
    watch.patch("/v1 decode (body read, JSON decode, unknown fields, field types)", gradients, "decode")
    watch.patch("  of which the body read (body.read_body: memory reservation, werkzeug stream)", body, "read_body",
                top_level=False)
    watch.patch("admission (core.admission.admit + reservation resize)", pipeline, "admit")
    watch.patch("admission (core.admission.admit + reservation resize)", pipeline, "reserve_for_request")
    watch.patch("convert (core to_matrix, build_request)", pipeline, "convert")
    watch.patch("compute slot + request_deadline", pipeline, "request_deadline")
    watch.patch("compute slot + request_deadline", slots.Gate, "acquire")
    watch.patch("engine (core.run: pass one)", pipeline, "run")
    watch.patch("render (gradients.render: render_result, Response)", gradients, "render")
    watch.patch_hooks("after_request hook (finisher, send timeout, log line, metrics)",
                      service.after_request_funcs.setdefault(None, []), only=record.after_request)
    watch.patch("  of which the request log line (log_request)", record, "log_request", top_level=False)
    for attribute in ("observe_request", "observe_work", "observe_device"):
        watch.patch("  of which metrics (observe_request, observe_work, observe_device)", record, attribute,
                    top_level=False)
    return watch


def service_stage_rows(calls: int = 1000) -> list[tuple[str, float]]:
    """The service's POST /v1/gradients in process, whole (not instrumented) and stage by stage."""
    service = quiet(create_app())
    call = wsgi_call(service, "POST", "/v1/gradients", BODY)
    whole = cpu_ms(call)
    watch = instrument(service)
    for _ in range(BATCH):  # warm-up, not counted
        call()
    watch.reset()
    start = time.thread_time()
    for _ in range(calls):
        call()
    timed_whole = 1e3 * (time.thread_time() - start) / calls
    stages = [(stage, 1e3 * spent / calls) for stage, spent in watch.spent.items()]
    top = sum(ms for stage, ms in stages if watch.top_level[stage])
    rows = [("service: POST /v1/gradients, whole app (WSGI call)", whole)] + [("  " + n, ms) for n, ms in stages]
    rows.append(("  the rest: Flask/werkzeug, flask-smorest/webargs wrappers, view glue (instrumented whole - stages)",
                 timed_whole - top))
    rows += [(f"  (not found, not timed: {name})", float("nan")) for name in watch.missing]
    return rows


def quiet(service: flask.Flask) -> flask.Flask:
    """The request log line is still made and written, to /dev/null."""
    for handler in logging.getLogger("blockgrad").handlers:
        if isinstance(handler, JsonStderrHandler):
            handler.setStream(open(os.devnull, "w"))
    return service


def other_rows() -> list[tuple[str, float]]:
    """The peer, its JSON encoder, and the least a Flask JSON view costs."""
    answer = peer.app.test_client().post("/v1/gradients", data=BODY, content_type="application/json").get_json()
    with peer.app.app_context():
        dumps_ms = cpu_ms(lambda: flask.json.dumps(answer))
    service = quiet(create_app())
    return [
        ("service: GET /healthz, whole app (every hook, log line, metrics)", cpu_ms(wsgi_call(service, "GET", "/healthz"))),
        ("peer: POST /v1/gradients, whole app (WSGI call)", cpu_ms(wsgi_call(peer.app, "POST", "/v1/gradients", BODY))),
        ("  of which flask.json.dumps of its answer (jsonify's encoder)", dumps_ms),
        ("bare Flask: POST, get_json + jsonify(ok=True) (WSGI call)", cpu_ms(wsgi_call(bare_flask(), "POST", "/echo", BODY))),
        ("orjson.dumps of the peer's answer (for comparison)", cpu_ms(lambda: orjson.dumps(answer))),
    ]


def served_rows(seconds: float = 3.0) -> list[tuple[str, float]]:
    """The server's share: workers' CPU per request of the no-op WSGI app, 1 and 4 clients,
    and the load driver's own CPU per request (keep-alive under gthread, a new connection
    per request under sync); gthread once more with worker recycling off."""
    from tools.server import gunicorn_server

    from .small_requests import peer_server, phase

    rows = []
    no_recycling = {"GUNICORN_CMD_ARGS": "--max-requests 0"}
    with gunicorn_server(workers=2, device="cpu", ready_path="/", app="bench.noop:app") as gthread, \
            gunicorn_server(workers=2, device="cpu", ready_path="/", app="bench.noop:app", env=no_recycling) as kept, \
            peer_server(2, 1, app="bench.noop:app") as sync:
        for name, server in (("gunicorn gthread (service settings)", gthread), ("gunicorn sync (peer settings)", sync),
                             ("gunicorn gthread, --max-requests 0 (no recycling)", kept)):
            for clients in (1, 4):
                measured = phase(server, clients, seconds, path="/")
                rows.append((f"{name}, no-op app, {clients} client(s): workers' CPU per request", measured.cpu_ms))
                rows.append(("  the load driver's CPU per request", measured.client_cpu_ms))
    rows += thread_rows(seconds)
    return rows


def thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of process `pid`, by thread id."""
    ticks_per_s = os.sysconf("SC_CLK_TCK")
    cpu = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        cpu[int(tid)] = (int(fields[11]) + int(fields[12])) / ticks_per_s  # utime, stime
    return cpu


def thread_rows(seconds: float) -> list[tuple[str, float]]:
    """The service serving the row's body, its workers' CPU per request split between the main
    loop's thread (the poller) and the others (pool threads computing; recycling off, so that
    every worker's threads are there to read)."""
    from tools.server import children, gunicorn_server

    from .rows import load

    rows = []
    with gunicorn_server(workers=2, device="cpu", ready_path="/readyz",
                         env={"GUNICORN_CMD_ARGS": "--max-requests 0"}) as server:
        load(server, "/v1/gradients", BODY, clients=4, seconds=1.0)
        for clients in (1, 4):
            workers = children(server.pid)
            before = {pid: thread_cpu_s(pid) for pid in workers}
            _, latencies, _ = load(server, "/v1/gradients", BODY, clients=clients, seconds=seconds)
            served = len(latencies) + 5 * clients  # rows.load's warm-up requests too
            main_s = pool_s = 0.0
            for pid in workers:
                for tid, cpu in thread_cpu_s(pid).items():
                    spent = cpu - before[pid].get(tid, 0.0)
                    if tid == pid:
                        main_s += spent
                    else:
                        pool_s += spent
            rows.append((f"service, 10x5 example, {clients} client(s): main loop thread's CPU per request",
                         1e3 * main_s / served))
            rows.append(("  the other threads' (pool threads: gunicorn's parser, the app)", 1e3 * pool_s / served))
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.stages", description=__doc__.splitlines()[0])
    parser.add_argument("--served", action="store_true", help="also measure the servers' share under load")
    served = parser.parse_args(argv).served
    torch.set_num_threads(int(gunicorn_settings()["torch_threads"]))  # as one gunicorn worker computes
    rows = service_stage_rows() + other_rows() + (served_rows() if served else [])
    for name, value in rows:
        print(f"{value:7.3f} ms  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
