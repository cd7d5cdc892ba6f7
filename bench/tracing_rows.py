"""Traces' cost (issue 32): the seed example through gunicorn as `make serve` runs it, tracing
on (exporting OTLP/HTTP to a collector in a process of its own, whose CPU is the collector's,
not the service's) against off, and off against the commit before tracing, and with 10% of
traces sampled (the SDK's own sampler) (its tree extracted with `git archive`, served by the
same gunicorn command and virtual environment), 1 and 4 clients. The servers run side by side
and are measured in alternated rounds, so all see the same load; ratios are medians over
rounds. The detail adds each server's workers' CPU time per request (every thread: the
exporter's too), which a busy machine disturbs less than the rate, and its own on/off row.

The SDK's floor, measured in the same run: a bare loop in a process of its own making a
request's spans as the service does (the server span and its four stage spans by
app.tracing.RequestSpan, the same attributes), with the same processor and exporter to the
same collector, every span exported; its CPU (every thread) per request, as a fraction of the
seed request's time with tracing off. If it is most of the 10%, no cheaper code can meet it."""
import contextlib
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tools.server import ROOT, Server, free_port, gunicorn_command, gunicorn_server, stop

from . import workloads
from .measure import Result, at_most
from .rows import load

BEFORE = "4e7dd7c"  # main before tracing (the merge of issue 31 and its last test fix)
ROUNDS = 15  # at 5, off against the same code before tracing read 1.11x on a noisy host (docs/benchmarks.md, "Traces")
ROUND_S = 2.0
SAMPLED = {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1"}


FLOOR_REQUESTS = 3000


class Sink(BaseHTTPRequestHandler):
    """An OTLP/HTTP collector that accepts every export (its decoding is the tests')."""
    received = None  # a shared counter of exports

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        with Sink.received.get_lock():
            Sink.received.value += 1
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def serve_sink(server: ThreadingHTTPServer, received) -> None:
    Sink.received = received
    server.serve_forever()


@contextlib.contextmanager
def sink_process():
    """The collector in a process of its own: (its endpoint, its count of exports)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    received = multiprocessing.Value("i", 0)
    process = multiprocessing.get_context("fork").Process(target=serve_sink, args=(server, received), daemon=True)
    process.start()
    server.server_close()  # the child's copy listens
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        process.kill()
        process.join()


def floor_ms(endpoint: str) -> tuple[float, float]:
    """The SDK's floor (module doc): (ms of CPU per request as the service makes its spans, the
    same with all five spans through the SDK's start_span and end), in a fresh interpreter."""
    out = subprocess.run([sys.executable, "-m", "bench.tracing_rows", "floor", str(FLOOR_REQUESTS)], cwd=ROOT,
                         env={**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint}, check=True,
                         capture_output=True, text=True).stdout
    service, sdk = map(float, out.split())
    return service, sdk


def floor_loop(requests: int) -> None:
    """Print the floor's two numbers (ms of CPU per request): each loop is one request's spans."""
    import app.tracing as tracing
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind, StatusCode

    assert tracing.configure()
    server_attributes = {"blockgrad.n": 10, "blockgrad.dim": 5, "blockgrad.factor": 2, "blockgrad.objective": "sum"}
    compute = {"blockgrad.bands": 1, "blockgrad.chunks": 1, "blockgrad.blocks_kept": True}

    def service() -> None:  # as record.py and pipeline.py make them
        server = tracing.RequestSpan("POST /v1/gradients", {}, time.time_ns(),
                                     {"blockgrad.request_id": os.urandom(16).hex()})
        server.attributes.update(server_attributes)
        now = time.time_ns()
        server.end([("decode", server.start_time, None), ("admit", now, None), ("compute", now, compute),
                    ("render", now, None)], now, 200, None)

    def sdk() -> None:  # every span through the SDK's start_span and end
        server = tracing.TRACER.start_span("POST /v1/gradients", None, SpanKind.SERVER,
                                           {"blockgrad.request_id": os.urandom(16).hex()})
        server.set_attributes(server_attributes)
        context = trace.set_span_in_context(server)
        for name in ("decode", "admit", "compute", "render"):
            tracing.TRACER.start_span(name, context, attributes=compute if name == "compute" else None).end()
        server.set_attributes({"blockgrad.status": 200, "blockgrad.outcome": "ok"})
        server.set_status(StatusCode.UNSET)
        server.end()

    results = []
    for spans in (service, sdk):
        for _ in range(requests // 10):  # warm-up
            spans()
        tracing.PROCESSOR.force_flush()
        started = time.process_time()
        for _ in range(requests):
            spans()
        tracing.PROCESSOR.force_flush()  # every span encoded and sent
        results.append((time.process_time() - started) / requests * 1e3)
    print(*results)


@contextlib.contextmanager
def commit_server(commit: str):
    """gunicorn serving `commit`'s tree (make serve's command, this virtual environment)."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        tree.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        port, log_path = free_port(), Path(tmp) / "gunicorn.log"
        env = {**os.environ, "BLOCKGRAD_BIND": f"127.0.0.1:{port}", "BLOCKGRAD_GRPC_BIND": f"127.0.0.1:{free_port()}",
               "BLOCKGRAD_DASK_SCHEDULER": "off", "BLOCKGRAD_DATA_DIR": f"{tmp}/data"}
        with open(log_path, "wb") as log_file:
            process = subprocess.Popen(gunicorn_command(), cwd=tree, env=env, stdout=log_file,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        try:
            server = Server(process, port, 2, log_path, None)
            server.wait_ready("/readyz")
            yield server
        finally:
            stop(process)


def workers_cpu_s(server: Server) -> float:
    """CPU seconds (user + system, every thread) the server's workers have used so far."""
    ticks = os.sysconf("SC_CLK_TCK")
    return sum(sum(map(int, Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[11:13])) / ticks
               for pid in server.worker_pids())


def tracing_cost(bench) -> list[Result]:
    body = workloads.body(workloads.SEED_EXAMPLE)
    results = []
    with sink_process() as (endpoint, received):
        on_env = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint}
        with gunicorn_server(workers=2, device=None, ready_path="/readyz", env=on_env) as on, \
                gunicorn_server(workers=2, device=None, ready_path="/readyz", env={**on_env, **SAMPLED}) as sampled, \
                gunicorn_server(workers=2, device=None, ready_path="/readyz") as off, \
                commit_server(BEFORE) as before:
            servers = {"on": on, "on 10%": sampled, "off": off, "before": before}
            for clients in (1, 4):
                rates, cpu = {name: [] for name in servers}, {name: [] for name in servers}
                for _ in range(ROUNDS):
                    for name, server in servers.items():
                        spent = workers_cpu_s(server)
                        rate, latencies, _ = load(server, "/v1/gradients", body, clients=clients, seconds=ROUND_S)
                        rates[name].append(rate)  # the CPU's requests: load's 5 warm-ups per client too
                        cpu[name].append((workers_cpu_s(server) - spent) / (len(latencies) + 5 * clients))
                on_off = statistics.median(o / t for o, t in zip(rates["off"], rates["on"]))  # time on / time off
                cpu_on_off = statistics.median(c / o for c, o in zip(cpu["on"], cpu["off"]))
                sampled_off = statistics.median(o / t for o, t in zip(rates["off"], rates["on 10%"]))
                off_before = statistics.median(b / o for b, o in zip(rates["before"], rates["off"]))
                detail = ", ".join(f"{name} {statistics.median(rates[name]):.0f} req/s, "
                                   f"{statistics.median(cpu[name]) * 1e3:.2f} ms CPU" for name in rates)
                if clients == 1:
                    off_ms, off_cpu_ms = 1e3 / statistics.median(rates["off"]), statistics.median(cpu["off"]) * 1e3
                results += [
                    Result(f"32. seed 10x5, {clients} client(s): traces on vs off (time per request)", "<= 1.10x",
                           f"{on_off:.2f}x", at_most(on_off, 1.10), f"{detail}; medians of {ROUNDS} alternated "
                           f"rounds of {ROUND_S:.0f} s"),
                    Result(f"32. seed 10x5, {clients} client(s): traces on vs off (workers' CPU per request)",
                           "- (info)", f"{cpu_on_off:.2f}x", "-", "every thread of the 2 workers, the exporter's too; "
                           "the collector's process not counted"),
                    Result(f"32. seed 10x5, {clients} client(s): traces on, 10% of traces sampled, vs off", "- (info)",
                           f"{sampled_off:.2f}x", "-", "OTEL_TRACES_SAMPLER=parentbased_traceidratio, _ARG=0.1"),
                    Result(f"32. seed 10x5, {clients} client(s): traces off vs {BEFORE} (before tracing)",
                           "within noise (<= 1.10x)", f"{off_before:.2f}x", at_most(off_before, 1.10), detail)]
            results[0] = replace(results[0], detail=f"{results[0].detail}; {received.value} exports received")
        service, sdk = floor_ms(endpoint)
    results.append(Result("32. the SDK's floor: a request's 5 spans made and exported by a bare loop, per request",
                          "- (info)", f"{service / off_ms:.2f} of off's time",
                          "-", f"{service:.3f} ms CPU ({service / off_cpu_ms:.2f} of off's workers' CPU per request, "
                          f"{off_ms:.2f} ms per request at 1 client); all five through the SDK's start_span and end: "
                          f"{sdk:.3f} ms; {FLOOR_REQUESTS} loops, the same batch processor and OTLP/HTTP exporter "
                          "to the same collector"))
    return results


if __name__ == "__main__" and sys.argv[1:2] == ["floor"]:
    floor_loop(int(sys.argv[2]))
