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
from app.http import metrics  # noqa: E402
from app.http.request_log import JsonStderrHandler  # noqa: E402

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
    """Wraps named functions where the request path looks them up (module attributes, Flask's
    hook lists) and adds up this thread's CPU time inside each; a name absent after a
    refactor is reported as such, not guessed."""

    def __init__(self):
        self.spent: dict[str, float] = {}
        self.missing: list[str] = []

    def wrap(self, name: str, fn: Callable) -> Callable:
        self.spent[name] = 0.0

        def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[name] += time.thread_time() - start

        return timed

    def patch(self, name: str, owner, attribute: str) -> None:
        if not hasattr(owner, attribute):
            self.missing.append(name)
            return
        setattr(owner, attribute, self.wrap(name, getattr(owner, attribute)))

    def patch_hook(self, name: str, hooks: list, fn: Callable) -> None:
        if fn not in hooks:
            self.missing.append(name)
            return
        hooks[hooks.index(fn)] = self.wrap(name, fn)


# (name, top level: not inside another timed stage). Top-level stages add up to at most the whole.
SERVICE_STAGES = (
    ("before_request hooks (observe: ids, timing; auth)", True),
    ("body read + JSON decode (webargs' json loader: http.parsing)", True),
    ("  of which the body read (read_body: memory reservation, werkzeug get_data)", False),
    ("/v1 schema load (marshmallow fields, pre_load admission, vectors conversion)", True),
    ("  of which admission in the schema (admit_document)", False),
    ("  of which vectors conversion (core.vectors.parse_matrix)", False),
    ("view: admit_request + compute_slot + request_deadline", True),
    ("engine (core.run: both passes)", True),
    ("render (render_result: head, blocks, join)", True),
    ("after_request hook (observe: finisher, send timeout, log line, metrics)", True),
    ("  of which the request log line (log_request)", False),
    ("  of which metrics (observe_request, observe_work, observe_device)", False),
)


def instrument(service: flask.Flask) -> Stopwatch:
    from app.api.v1 import schemas, views
    from app.http import observe, parsing

    watch = Stopwatch()
    names = [name for name, _ in SERVICE_STAGES]
    before = service.before_request_funcs.setdefault(None, [])
    for k, hook in enumerate(list(before)):  # every before_request hook, as one stage
        before[k] = watch.wrap(f"{names[0]} #{k}", hook)
    watch.patch_hook(names[9], service.after_request_funcs.setdefault(None, []), observe.after_request)
    watch.patch(names[1], parsing.OrjsonParser, "_raw_load_json")
    watch.patch(names[2], parsing, "read_body")
    watch.patch(names[3], schemas.GradientRequestSchema, "load")
    watch.patch(names[4], schemas, "admit_document")
    watch.patch(names[5], schemas, "parse_matrix")
    for attribute in ("admit_request", "compute_slot", "request_deadline"):
        watch.patch(f"{names[6]} ({attribute})", views, attribute)
    watch.patch(names[7], views, "run")
    watch.patch(names[8], views, "render_result")
    watch.patch(names[10], observe, "log_request")
    for attribute in ("observe_request", "observe_work", "observe_device"):
        watch.patch(f"{names[11]} ({attribute})", metrics, attribute)
    return watch


def by_stage(watch: Stopwatch, calls: int) -> list[tuple[str, float]]:
    """Milliseconds per request of each stage, the parts of a stage (" (read)", " #0") summed."""
    return [(name, 1e3 * sum(spent for key, spent in watch.spent.items() if key.startswith(name)) / calls)
            for name, _ in SERVICE_STAGES]


def service_stage_rows(calls: int = 1000) -> list[tuple[str, float]]:
    """The service's POST /v1/gradients in process, whole and stage by stage."""
    service = quiet(create_app())
    call = wsgi_call(service, "POST", "/v1/gradients", BODY)
    whole = cpu_ms(call)
    watch = instrument(service)
    for _ in range(BATCH):  # warm-up, not counted
        call()
    watch.spent = dict.fromkeys(watch.spent, 0.0)
    start = time.thread_time()
    for _ in range(calls):
        call()
    timed_whole = 1e3 * (time.thread_time() - start) / calls
    stages = by_stage(watch, calls)
    top = sum(ms for (name, ms), (_, top_level) in zip(stages, SERVICE_STAGES) if top_level)
    rows = [("service: POST /v1/gradients, whole app (WSGI call)", whole)] + [("  " + n, ms) for n, ms in stages]
    rows.append(("  the rest: Flask/werkzeug, flask-smorest/webargs wrappers, view glue (whole - stages)",
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
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.stages", description=__doc__.splitlines()[0])
    parser.add_argument("--served", action="store_true", help="also measure the servers' share under load")
    served = parser.parse_args(argv).served
    torch.set_num_threads(1)  # one gunicorn worker's threads on this 2-core machine
    rows = service_stage_rows() + other_rows() + (served_rows() if served else [])
    for name, value in rows:
        print(f"{value:7.3f} ms  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
