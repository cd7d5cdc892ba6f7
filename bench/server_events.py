"""Events per request of one gunicorn worker under the small-requests load: CPU time and
context switches of its main loop and of its other threads (/proc/<pid>/task/*/schedstat and
status), and optionally system calls (strace -c -f attached for one more phase).

    python -m bench.server_events [--app noop|service] [--clients 1 4] [--seconds 3] [--strace]

Counts move much less than rates on a shared machine: they say what the server does per
request (docs/small-requests.md). One worker, `--max-requests 0`, so that every request is
served by the process measured.
"""
import argparse
import collections
import contextlib
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from tools.server import gunicorn_server

from .rows import load
from .small_requests import BODY, LOAD_WARM_UP, NOOP_APP


def threads(pid: int) -> dict[int, tuple[int, int, int]]:
    """tid -> (ns on CPU, voluntary switches, involuntary switches) of each thread of `pid`."""
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            ran = int((task / "schedstat").read_text().split()[0])
            status = dict(line.split(":\t", 1) for line in (task / "status").read_text().splitlines() if ":\t" in line)
            found[int(task.name)] = (ran, int(status["voluntary_ctxt_switches"]),
                                     int(status["nonvoluntary_ctxt_switches"]))
    return found


def per_request(pid: int, before: dict, after: dict, served: int) -> dict[str, float]:
    """CPU microseconds and switches per request, main loop (tid == pid) apart from the rest."""
    sums = collections.Counter()
    for tid, (ran, vol, invol) in after.items():
        ran0, vol0, invol0 = before.get(tid, (0, 0, 0))
        where = "main" if tid == pid else "other"
        sums[f"{where}_cpu_us"] += (ran - ran0) / 1e3
        sums[f"{where}_voluntary"] += vol - vol0
        sums[f"{where}_involuntary"] += invol - invol0
    return {key: value / served for key, value in sorted(sums.items())}


def syscalls(pid: int, server, path: str, clients: int, seconds: float) -> tuple[dict[str, float], int]:
    """System calls per request of every thread of `pid` during one phase (strace -c -f)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "strace.txt"
        tids = [str(tid) for tid in threads(pid)]
        tracer = subprocess.Popen(["strace", "-c", "-f", "-o", str(out), *[a for t in tids for a in ("-p", t)]],
                                  stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # attached
        try:
            _, latencies, _ = load(server, path, BODY, clients=clients, seconds=seconds)
        finally:
            tracer.send_signal(signal.SIGINT)
            tracer.wait(30)
        served = len(latencies) + LOAD_WARM_UP * clients
        counts = {}
        for line in out.read_text().splitlines():
            fields = line.split()
            if len(fields) >= 5 and fields[0][0].isdigit() and fields[-1] != "total":
                counts[fields[-1]] = int(fields[3]) / served
        return dict(sorted(counts.items(), key=lambda kv: -kv[1])), served


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--app", choices=("noop", "service"), default="noop")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--strace", action="store_true")
    args = parser.parse_args()
    noop = args.app == "noop"
    path = "/" if noop else "/v1/gradients"
    env = {"GUNICORN_CMD_ARGS": "--max-requests 0"}
    with gunicorn_server(workers=1, env=env, device=None if noop else "cpu", ready_path="/" if noop else "/readyz",
                         app=NOOP_APP if noop else "wsgi:app") as server:
        pid = server.worker_pids()[0]
        load(server, path, BODY, clients=max(args.clients), seconds=1.0)  # warm-up: the pool's threads exist
        for clients in args.clients:
            before = threads(pid)
            rate, latencies, _ = load(server, path, BODY, clients=clients, seconds=args.seconds)
            served = len(latencies) + LOAD_WARM_UP * clients
            counts = per_request(pid, before, threads(pid), served)
            print(f"{args.app} {clients} client(s): {rate:.0f} req/s, {served} requests; per request: "
                  + ", ".join(f"{key} {value:.2f}" for key, value in counts.items()), flush=True)
            if args.strace:
                calls, traced = syscalls(pid, server, path, clients, args.seconds)
                print(f"  strace ({traced} requests), calls per request: "
                      + ", ".join(f"{name} {value:.2f}" for name, value in calls.items() if value >= 0.05), flush=True)


if __name__ == "__main__":
    main()
