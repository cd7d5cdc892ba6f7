"""A lone request on idle cores, in process: S_lone against S_pair (docs/cores.md).

S_lone = t(1 slot) / t(2 slots): one request's pass one (what an `accumulated` request
computes) serially on the default chunks, then on two slots with cache-sized chunks.
S_pair = 2 x t(one alone, 1 slot) / t(until both of two concurrent 1-slot runs finish):
what the second core gives two independent requests on this machine, the bound S_lone is
measured against. Beside them the bound of the chunks themselves: a plain loop of the engine
over the parallel chunks on one thread against two (S_plain). Medians of `repeats`, every run
on a thread other than the main one, one torch thread, as in a worker.

Served rows (`make bench`, gunicorn as `make serve` runs it): `concurrent_pairs_balance`, 20
pairs of the same request over HTTP on fresh connections, sent at the same moment, the slower
of each pair against the faster (the issue: at most 1.3x, none one after the other); and
`lone_request_cpu`, the CPU time of the master's descendants during a lone request over its
wall time (at least 1.7 on 2 cores); `four_concurrent_requests`, four such requests at once,
total throughput with the default BLOCKGRAD_SLOTS_PER_REQUEST against 1 (at least 1.0).

`--chunks`: the chunk-size probe instead: the engine's chunks of several sizes on one thread
and on two threads (every other chunk each), with CPU time and how much the threads overlap:
on a loaded machine those say more than wall time.

Usage: python -m bench.cores [--repeats 5] [--n 2048] [--dim 64] [--factor 32] [--chunks | --served]
"""
import argparse
import json
import os
import statistics
import threading
import time

import requests
import torch

from app.core.engine import (DEFAULT_CHUNK_ELEMENTS, PARALLEL_CHUNK_ELEMENTS, add_to_vectors, chain_rule_sums,
                             chunk_gradients, plan_bands)
from app.core.run import LocalExecutor, PassOne, SerialExecutor
from app.core.objectives import OBJECTIVES
from app.core.slots import ThreadSlots

from tools.server import children, cpu_ticks, gunicorn_server

from .measure import Result, all_started_together, at_least, at_most
from .workloads import vectors as random_vectors

TARGET_SHARE = 0.9  # S_lone >= 0.9 x S_pair
PAIRS = 20
TARGET_PAIR_RATIO = 1.3  # the slower of a pair at most 1.3x the faster
TARGET_CPU_SHARE = 1.7  # a lone request: CPU of the master's descendants >= 1.7 x wall (2 cores)
CONCURRENT = 4  # large requests at once
TARGET_CONCURRENT_RATIO = 1.0  # their throughput on shared slots at least that on one slot each


def planned_chunks(n: int, dim: int, factor: int, parallel: bool) -> list:
    size = PARALLEL_CHUNK_ELEMENTS if parallel else DEFAULT_CHUNK_ELEMENTS
    return [chunk for band in plan_bands(n, dim, factor, size) for chunk in band]


def pass_one(executor, vectors: torch.Tensor, factor: int, parallel: bool, objective: str = "sum") -> torch.Tensor:
    """Pass one as app/core/run.py does it: `planned_chunks(...)`'s chunks, losses placed, the accumulated
    gradient, one host synchronisation."""
    size = PARALLEL_CHUNK_ELEMENTS if parallel else DEFAULT_CHUNK_ELEMENTS
    run = PassOne(executor, vectors, factor, size, OBJECTIVES[objective], 5.0)
    for _ in run:
        pass
    assert run.surely_finite()
    return run.rows_sum


def timed_with_cpu(fn) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds, every thread) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def on_a_thread(fn):
    """fn() on a thread of its own, as a gunicorn worker computes (in a pool thread, never
    the main one: glibc serves the main thread's temporaries from another arena, which here
    page-faults a 1M chunk's temporaries in afresh every chunk; docs/cores.md)."""
    thread = threading.Thread(target=fn)
    thread.start()
    thread.join()


def two_at_once(fn, args=((), ())) -> float:
    """Seconds until both of two concurrent calls fn(*args[0]), fn(*args[1]) have returned."""
    return all_started_together([lambda arg=arg: fn(*arg) for arg in args])


def plain_loop(vectors: torch.Tensor, plan: list, objective: str = "sum") -> None:
    """The bound: the engine's work on the chunks and nothing else (no executor, no slots,
    no results consumed), one partial accumulated gradient."""
    partial, fn = torch.zeros_like(vectors), OBJECTIVES[objective]
    for chunk in plan:
        add_to_vectors(partial, partial, chunk, chain_rule_sums(chunk_gradients(vectors, chunk, fn, 5.0)))


def lone_request_speedup(bench=None, n: int = 2048, dim: int = 64, factor: int = 32,
                         repeats: int = 5) -> list[Result]:
    """`bench` unused: the signature of bench/rows.py's rows. Every run on a thread other
    than the main one, as in a worker. Beside S_lone, the bound: a plain loop of the engine
    over the same parallel chunks, on one thread against two threads each taking every other
    chunk (S_plain)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    slots = ThreadSlots(2)
    own = slots.try_acquire()  # the request's own, as the gate hands it over
    executor = LocalExecutor(slots, slots_per_request=2)
    load = os.getloadavg()[0]
    try:
        vectors = torch.as_tensor(random_vectors(n, dim), dtype=torch.float32)  # (N, D)
        serial_plan, parallel_plan = planned_chunks(n, dim, factor, False), planned_chunks(n, dim, factor, True)

        def alone():
            return pass_one(SerialExecutor(), vectors, factor, False)

        def on_two():
            return pass_one(executor, vectors, factor, True)

        torch.testing.assert_close(on_two(), alone(), rtol=2e-5, atol=2e-5)  # warm-up, and the same answer
        one, two, pair, cpu_share, plain_one, plain_two = [], [], [], [], [], []
        for _ in range(repeats):  # interleaved: each kind sees the same load
            one.append(timed_with_cpu(lambda: on_a_thread(alone))[0])
            wall, cpu = timed_with_cpu(lambda: on_a_thread(on_two))
            two.append(wall)
            cpu_share.append(cpu / wall)
            pair.append(two_at_once(alone))
            plain_one.append(timed_with_cpu(lambda: on_a_thread(lambda: plain_loop(vectors, parallel_plan)))[0])
            plain_two.append(two_at_once(plain_loop, ((vectors, parallel_plan[0::2]), (vectors, parallel_plan[1::2]))))
    finally:
        own.release()
        executor.shutdown()
        torch.set_num_threads(threads)
    t1, t2, tp = statistics.median(one), statistics.median(two), statistics.median(pair)
    p1, p2 = statistics.median(plain_one), statistics.median(plain_two)
    s_lone, s_pair, s_plain = t1 / t2, 2 * t1 / tp, p1 / p2
    return [Result(f"cores. lone request on 2 slots (in process), N={n} D={dim} F={factor} accumulated",
                   f"S_lone >= {TARGET_SHARE} x S_pair", f"{s_lone:.2f} vs {s_pair:.2f} ({s_lone / s_pair:.2f})",
                   at_least(s_lone, TARGET_SHARE * s_pair),
                   f"t(1 slot) {t1 * 1e3:.0f} ms, t(2 slots) {t2 * 1e3:.0f} ms, pair of 1-slot runs "
                   f"{tp * 1e3:.0f} ms; CPU/wall on 2 slots {statistics.median(cpu_share):.2f}; "
                   f"chunks {len(serial_plan)} serial, {len(parallel_plan)} parallel; bound: a plain loop on "
                   f"the parallel chunks {p1 * 1e3:.0f} ms on 1 thread, {p2 * 1e3:.0f} ms on 2 (S_plain "
                   f"{s_plain:.2f}; 2 slots vs 2 plain threads {p2 / t2:.2f}); load average {load:.2f}")]


def served_body(n: int = 2048, dim: int = 64, factor: int = 32) -> bytes:
    return json.dumps({"vectors": random_vectors(n, dim).tolist(), "factor": factor,
                       "outputs": ["accumulated"]}).encode()


def timed_post(url: str, body: bytes) -> float:
    """Seconds until the whole answer is read, on a fresh connection."""
    began = time.perf_counter()
    response = requests.post(url, data=body, headers={"Content-Type": "application/json", "Connection": "close"},
                             timeout=300)
    response.raise_for_status()
    return time.perf_counter() - began


def concurrent_pairs_balance(bench, pairs: int = PAIRS) -> list[Result]:
    """PAIRS pairs of N = 2048 requests sent at the same moment on fresh connections: the
    slower of each pair over the faster. Near 1: both computed side by side; near 2: one
    waited for the other."""
    server = bench.server()
    url, body = server.url + "/v1/gradients", served_body()
    timed_post(url, body)  # warm: both workers have run one
    timed_post(url, body)
    ratios = []
    for _ in range(pairs):
        barrier, times = threading.Barrier(2), [0.0, 0.0]

        def one(index: int):
            barrier.wait()
            times[index] = timed_post(url, body)
        threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        ratios.append(max(times) / min(times))
    worst = max(ratios)
    return [Result(f"cores. {pairs} concurrent pairs, N=2048 D=64 F=32 accumulated, fresh connections",
                   f"slower/faster <= {TARGET_PAIR_RATIO} in every pair", f"{worst:.2f} worst",
                   at_most(worst, TARGET_PAIR_RATIO),
                   f"median {statistics.median(ratios):.2f}; {sum(r > TARGET_PAIR_RATIO for r in ratios)} of "
                   f"{pairs} pairs over {TARGET_PAIR_RATIO}")]


def all_at_once(url: str, body: bytes, clients: int) -> float:
    """Seconds until every one of `clients` requests sent at the same moment (fresh
    connections) has been answered."""
    errors = []

    def one():
        try:
            timed_post(url, body)
        except Exception as exc:  # reported below: a failed request is no throughput
            errors.append(exc)
    seconds = all_started_together([one] * clients)
    if errors:
        raise RuntimeError(f"{len(errors)} of {clients} concurrent requests failed: {errors[0]!r}")
    return seconds


def four_concurrent_requests(bench, rounds: int = 9, clients: int = CONCURRENT) -> list[Result]:
    """`clients` concurrent N = 2048 requests on `make serve`'s configuration, total throughput
    with the default BLOCKGRAD_SLOTS_PER_REQUEST (all the pod's slots) against 1 (one slot a
    request), on two servers side by side, rounds interleaved; medians of `rounds`."""
    shared = bench.server()
    with gunicorn_server(workers=None, device=None, ready_path="/readyz",
                         env={"BLOCKGRAD_SLOTS_PER_REQUEST": "1"}) as capped:
        body = served_body()
        urls = {"shared": shared.url + "/v1/gradients", "capped": capped.url + "/v1/gradients"}
        for url in urls.values():
            all_at_once(url, body, clients)  # warm: every worker has run one
        times: dict[str, list[float]] = {"shared": [], "capped": []}
        load = os.getloadavg()[0]
        for _ in range(rounds):
            for kind, url in urls.items():
                times[kind].append(all_at_once(url, body, clients))
    t_shared, t_capped = statistics.median(times["shared"]), statistics.median(times["capped"])
    ratio = t_capped / t_shared  # throughput shared / throughput capped
    return [Result(f"cores. {clients} concurrent requests, N=2048 D=64 F=32 accumulated, all slots vs 1 a request",
                   f"throughput ratio >= {TARGET_CONCURRENT_RATIO}", f"{ratio:.2f}",
                   at_least(ratio, TARGET_CONCURRENT_RATIO),
                   f"{clients} answered in {t_shared * 1e3:.0f} ms ({clients / t_shared:.2f} req/s) with the "
                   f"default, {t_capped * 1e3:.0f} ms ({clients / t_capped:.2f} req/s) with "
                   f"BLOCKGRAD_SLOTS_PER_REQUEST=1; medians of {rounds}; load average {load:.2f}")]


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        for child in children(todo.pop()):
            found.append(child)
            todo.append(child)
    return found


def lone_request_cpu(bench, repeats: int = 5) -> list[Result]:
    """CPU time of every process under gunicorn's master during a lone request, over its wall
    time (from /proc/<pid>/stat; the master itself computes nothing); median of `repeats`."""
    server = bench.server()
    url, body = server.url + "/v1/gradients", served_body()
    timed_post(url, body)
    tick = os.sysconf("SC_CLK_TCK")
    shares, walls = [], []
    for _ in range(repeats):
        pids = descendants(server.pid)
        before = {pid: cpu_ticks(pid) for pid in pids}
        wall = timed_post(url, body)
        used = sum(cpu_ticks(pid) - ticks for pid, ticks in before.items())
        shares.append(used / tick / wall)
        walls.append(wall)
    share = statistics.median(shares)
    return [Result("cores. lone request's CPU/wall over the pod (served), N=2048 D=64 F=32 accumulated",
                   f">= {TARGET_CPU_SHARE} (2 cores)", f"{share:.2f}", at_least(share, TARGET_CPU_SHARE),
                   f"wall median {statistics.median(walls) * 1e3:.0f} ms; ticks of {tick} Hz")]


# (factor, numbers per chunk) at N = 2048, D = 64: chunks of 128K to 4M numbers.
PROBE_CHUNKS = [(64, 128 * 1024), (64, 256 * 1024), (32, 512 * 1024), (64, 1024 * 1024), (64, 2048 * 1024),
               (32, 4096 * 1024)]


def overlap_seconds(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Seconds in which an interval of `a` and one of `b` both ran (each list in time order)."""
    total, j = 0.0, 0
    for start, stop in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < stop:
            total += max(0.0, min(stop, b[k][1]) - max(start, b[k][0]))
            k += 1
    return total


def chunk_probe(n: int = 2048, dim: int = 64, repeats: int = 3) -> list[str]:
    """One line per chunk size: CPU seconds on one thread and on two, their overlap, wall speedup."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    vectors = torch.as_tensor(random_vectors(n, dim), dtype=torch.float32)  # (N, D)
    objective = OBJECTIVES["sum"]
    lines = []

    def work(chunks, log):
        for chunk in chunks:
            began = time.monotonic()
            chain_rule_sums(chunk_gradients(vectors, chunk, objective, 5.0))
            log.append((began, time.monotonic()))

    try:
        for factor, size in PROBE_CHUNKS:
            chunks = [chunk for band in plan_bands(n, dim, factor, size) for chunk in band]
            numbers = chunks[0].count * chunks[0].height * chunks[0].width * 2 * dim
            work(chunks[:4], [])  # warm-up
            runs = []
            for _ in range(repeats):
                one_wall, one_cpu = timed_with_cpu(lambda: work(chunks, []))
                logs = ([], [])
                pair = [threading.Thread(target=work, args=(chunks[i::2], logs[i])) for i in (0, 1)]
                two_wall, two_cpu = timed_with_cpu(lambda: ([t.start() for t in pair], [t.join() for t in pair]))
                runs.append((one_cpu, two_cpu / one_cpu, overlap_seconds(*logs) / two_wall, one_wall / two_wall))
            one_cpu, cpu_ratio, overlap, speedup = (statistics.median(r[k] for r in runs) for k in range(4))
            lines.append(f"chunk {numbers // 1024}K numbers (F={factor}), {len(chunks)} chunks: CPU 1 thread "
                         f"{one_cpu:.3f} s, CPU 2 threads / 1 thread {cpu_ratio:.2f}, overlap {overlap:.2f}, "
                         f"wall speedup {speedup:.2f}")
    finally:
        torch.set_num_threads(threads)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.cores", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--factor", type=int, default=32)
    parser.add_argument("--chunks", action="store_true", help="the chunk-size probe instead")
    parser.add_argument("--served", action="store_true", help="the served rows instead (gunicorn as make serve)")
    args = parser.parse_args()
    if args.served:
        from .rows import Bench

        bench = Bench(torch_threads=1)
        try:
            for row in (lone_request_cpu, four_concurrent_requests):
                for result in row(bench):
                    print(" | ".join((result.name, result.target, result.measured, result.verdict, result.detail)),
                          flush=True)
        finally:
            bench.close()
        return
    if args.chunks:
        for line in chunk_probe(args.n, args.dim, args.repeats):
            print(line, flush=True)
        return
    for result in lone_request_speedup(None, args.n, args.dim, args.factor, args.repeats):
        print(" | ".join((result.name, result.target, result.measured, result.verdict, result.detail)), flush=True)


if __name__ == "__main__":
    main()
