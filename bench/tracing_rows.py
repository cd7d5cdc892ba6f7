"""Traces' cost (issue 32): the seed example through gunicorn as `make serve` runs it, tracing
on (exporting OTLP/HTTP to a receiver in this process) against off, and off against the
commit before tracing, and with 10% of traces sampled (the SDK's own sampler) (its tree extracted with `git archive`, served by the same gunicorn
command and virtual environment), 1 and 4 clients. The three servers run side by side and
are measured in alternated rounds, so all see the same load; ratios are medians over rounds.
The detail adds each server's workers' CPU time per request (every thread: the exporter's
too), which a busy machine disturbs less than the rate."""
import contextlib
import os
import statistics
import subprocess
import tempfile
import threading
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tools.server import ROOT, Server, free_port, gunicorn_command, gunicorn_server, stop

from . import workloads
from .measure import Result, at_most
from .rows import load

BEFORE = "4e7dd7c"  # main before tracing (the merge of issue 31 and its last test fix)
ROUNDS = 5
ROUND_S = 2.0
SAMPLED = {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1"}


class Sink(BaseHTTPRequestHandler):
    """An OTLP/HTTP collector that accepts every export (its decoding is the tests')."""
    received = 0

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        Sink.received += 1
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


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
    sink = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    on_env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink.server_address[1]}"}
    results = []
    try:
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
                        rates[name].append(rate)
                        cpu[name].append((workers_cpu_s(server) - spent) / len(latencies))
                on_off = statistics.median(o / t for o, t in zip(rates["off"], rates["on"]))  # time on / time off
                sampled_off = statistics.median(o / t for o, t in zip(rates["off"], rates["on 10%"]))
                off_before = statistics.median(b / o for b, o in zip(rates["before"], rates["off"]))
                detail = ", ".join(f"{name} {statistics.median(rates[name]):.0f} req/s, "
                                   f"{statistics.median(cpu[name]) * 1e3:.2f} ms CPU" for name in rates)
                results += [
                    Result(f"32. seed 10x5, {clients} client(s): traces on vs off (time per request)", "<= 1.10x",
                           f"{on_off:.2f}x", at_most(on_off, 1.10), f"{detail}; medians of {ROUNDS} alternated "
                           f"rounds of {ROUND_S:.0f} s"),
                    Result(f"32. seed 10x5, {clients} client(s): traces on, 10% of traces sampled, vs off", "- (info)",
                           f"{sampled_off:.2f}x", "-", "OTEL_TRACES_SAMPLER=parentbased_traceidratio, _ARG=0.1"),
                    Result(f"32. seed 10x5, {clients} client(s): traces off vs {BEFORE} (before tracing)",
                           "within noise (<= 1.10x)", f"{off_before:.2f}x", at_most(off_before, 1.10), detail)]
            results[0] = replace(results[0], detail=f"{results[0].detail}; {Sink.received} exports received")
    finally:
        sink.shutdown()
    return results
