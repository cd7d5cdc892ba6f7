"""Timing helpers and the result table."""
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Result:
    """One line of the table."""
    name: str
    target: str  # e.g. ">= 50x", "< 600 MB", "-" when the issue sets none
    measured: str  # e.g. "212x", "412 MB"
    verdict: str  # PASS, MISS or "-"
    detail: str  # the times behind the ratio


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def median_time(fn: Callable[[], object], repeats: int = 5, budget_s: float = 20.0) -> float:
    """Median seconds of up to `repeats` runs; stops early once `budget_s` is spent (one run at least)."""
    times, spent = [], 0.0
    while len(times) < repeats and (not times or spent < budget_s):
        elapsed, _ = timed(fn)
        times.append(elapsed)
        spent += elapsed
    return statistics.median(times)


@dataclass(frozen=True)
class Paired:
    a_s: float  # median seconds of a
    b_s: float  # median seconds of b
    ratio: float  # median of a / b over adjacent pairs


def paired(fn_a: Callable[[], object], fn_b: Callable[[], object], repeats: int = 7,
           budget_s: float = 40.0) -> Paired:
    """Run a and b alternately, so both see the same load on a shared machine; the ratio is
    the median over adjacent pairs. Stops early once `budget_s` is spent (one pair at least)."""
    a_times, b_times, spent = [], [], 0.0
    while len(a_times) < repeats and (not a_times or spent < budget_s):
        a, _ = timed(fn_a)
        b, _ = timed(fn_b)
        a_times.append(a)
        b_times.append(b)
        spent += a + b
    ratios = [a / b for a, b in zip(a_times, b_times)]
    return Paired(statistics.median(a_times), statistics.median(b_times), statistics.median(ratios))


def at_least(value: float, target: float) -> str:
    return "PASS" if value >= target else "MISS"


def at_most(value: float, target: float) -> str:
    return "PASS" if value <= target else "MISS"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def table(results: list[Result]) -> str:
    """A Markdown table: readable in a terminal, pasted as is into docs/benchmarks.md."""
    header = ("row", "target", "measured", "verdict", "detail")
    lines = [header, ("---",) * 5] + [(r.name, r.target, r.measured, r.verdict, r.detail) for r in results]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def all_started_together(calls: list[Callable[[], object]]) -> float:
    """Seconds until every one of `calls`, each on a thread of its own and released at the same
    moment, has returned."""
    barrier = threading.Barrier(len(calls) + 1)

    def one(call):
        barrier.wait()
        call()
    threads = [threading.Thread(target=one, args=(call,)) for call in calls]
    for thread in threads:
        thread.start()
    barrier.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    return time.perf_counter() - began


def clients_rate(make_call: Callable[[], Callable[[], object]], clients: int, seconds: float,
                 calls: int | None = None, warm: int = 3) -> tuple[float, float, int]:
    """(requests per second, median latency, requests) of `clients` threads at once, each with
    its own call (`make_call()`: its own connection), warmed `warm` times, then calling for
    `seconds` (and at most `calls` times)."""
    latencies, lock = [], threading.Lock()

    def client():
        call, mine = make_call(), []
        for _ in range(warm):
            call()
        stop = time.monotonic() + seconds
        while (calls is None or len(mine) < calls) and (not mine or time.monotonic() < stop):
            start = time.perf_counter()
            call()
            mine.append(time.perf_counter() - start)
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return len(latencies) / (time.perf_counter() - start), statistics.median(latencies), len(latencies)
