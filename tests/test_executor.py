"""The chunk executor: parallel chunks give the serial engine's bits for blocks and losses and
the seed loops' accumulated gradient; slots are taken only when free, one chunk at a time,
and given back at chunk boundaries, so a request arriving meanwhile gets one."""
import threading

import pytest
import torch

from app.core.engine import (PARALLEL_CHUNK_ELEMENTS, add_to_vectors, chain_rule_sums, chunk_gradients,
                             elements_per_chunk, plan_bands)
from app.core.run import LocalExecutor, PassOne, SerialExecutor
from app.core.slots import ThreadSlots
from app.core.objectives import OBJECTIVES
from app.core.settings import Settings

from tools.reference import batch_matrix, concat_matrix, reference_accumulated, reference_blocks

from .numeric import assert_matches, loss_terms

WAIT_S = 60.0  # bounds on every wait; never reached unless something is broken


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: bitwise comparisons need it


class CountingSlots(ThreadSlots):
    """ThreadSlots that count what was taken: tries, grants, most held at once."""

    def __init__(self, count: int):
        super().__init__(count)
        self.tries = self.grants = self.most_busy = 0

    def try_acquire(self):
        self.tries += 1
        slot = super().try_acquire()
        if slot is not None:
            self.grants += 1
            self.most_busy = max(self.most_busy, self.busy)
        return slot


def chunks_of(n, dim, factor, max_elements):
    return [chunk for band in plan_bands(n, dim, factor, max_elements) for chunk in band]


def serial_pass(vectors, chunks, objective, offset):
    results, accumulated = [], torch.zeros_like(vectors)
    for chunk in chunks:
        result = chunk_gradients(vectors, chunk, OBJECTIVES[objective], offset)
        add_to_vectors(accumulated, accumulated, chunk, chain_rule_sums(result))
        results.append(result)
    return results, accumulated


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
def test_parallel_tiles_are_the_serial_bits_and_the_seed_loops_accumulated(objective, dtype):
    torch.manual_seed(5)
    vectors = torch.randn(61, 3, dtype=dtype) * 3  # 61 = 9 x 6 + 7: the remainder blocks too
    factor, offset = 9, 2.5
    chunks = chunks_of(61, 3, factor, 300)  # many chunks of a few blocks each
    slots = CountingSlots(3)
    own = slots.try_acquire()  # the request's own slot, as the gate hands it over
    executor = LocalExecutor(slots, slots_per_request=3)
    try:
        run = PassOne(executor, vectors, factor, 300, OBJECTIVES[objective], offset)
        parallel = list(run)
        accumulated = run.rows_sum
    finally:
        executor.shutdown()
        own.release()
    assert slots.grants > 0, "no chunk ran on an extra slot"
    assert slots.busy == 0
    expected, serial_accumulated = serial_pass(vectors, chunks, objective, offset)
    assert [t.chunk for t in parallel] == chunks  # in the plan's order
    for got, want in zip(parallel, expected, strict=True):
        assert torch.equal(got.losses, want.losses)
        assert torch.equal(got.gradient, want.gradient)
    assert run.surely_finite()
    # The consumer adds the lanes' sums in the chunks' order: the serial pass's bits.
    assert torch.equal(accumulated, serial_accumulated)
    # The literal loops in float64 on the same values: the oracle.
    wide = vectors.to(torch.float64)
    assert_matches(accumulated, reference_accumulated(wide, factor, objective, offset), dtype, what="accumulated")
    # Blocks against the literal loops: row-block-major, (r, c) -> the seed's order j * F + i.
    seed = reference_blocks(wide, factor, objective, offset)
    blocks = batch_matrix(concat_matrix(wide), factor=factor)
    checked = 0
    for result in parallel:
        chunk = result.chunk
        for i, r in enumerate(chunk.rows):
            for j, c in enumerate(chunk.cols):
                loss, gradient = seed[r * factor + c]
                assert_matches(result.losses[i, j], loss, dtype, scale=loss_terms(blocks[r * factor + c],
                                                                                        objective, offset),
                               what=f"block ({r}, {c}) loss")
                assert_matches(result.gradient[i, j], gradient, dtype, what=f"block ({r}, {c}) gradient")
                checked += 1
    assert checked == factor * factor


def test_serial_executor_is_the_engine_exactly():
    torch.manual_seed(1)
    vectors = torch.randn(40, 4)
    chunks = chunks_of(40, 4, 7, 500)
    run = PassOne(SerialExecutor(), vectors, 7, 500, OBJECTIVES["logsumexp"], 1.0)
    results = list(run)
    expected, accumulated = serial_pass(vectors, chunks, "logsumexp", 1.0)
    assert len(results) == len(expected) == len(chunks)
    assert all(torch.equal(a.gradient, b.gradient) for a, b in zip(results, expected, strict=True))
    assert torch.equal(run.rows_sum, accumulated)  # one lane: the serial order of additions


def test_one_slot_per_request_is_serial_and_bitwise_the_engine():
    torch.manual_seed(2)
    vectors = torch.randn(40, 4)
    chunks = chunks_of(40, 4, 7, 500)
    slots = CountingSlots(4)
    executor = LocalExecutor(slots, slots_per_request=1)
    run = PassOne(executor, vectors, 7, 500, OBJECTIVES["sum_of_squares"], 0.0)
    list(run)
    assert slots.tries == 0
    assert torch.equal(run.rows_sum, serial_pass(vectors, chunks, "sum_of_squares", 0.0)[1])


def test_a_request_of_one_tile_runs_inline_with_no_hand_over():
    slots = CountingSlots(2)
    executor = LocalExecutor(slots, slots_per_request=2)
    try:
        caller = threading.get_ident()
        threads = list(executor.map_chunks(lambda chunk: threading.get_ident(), ["only"]))
        chunks = chunks_of(10, 5, 2, 10 ** 6)
        assert len(chunks) == 1  # the seed's 10 x 5 example is one chunk
        list(PassOne(executor, torch.randn(10, 5), 2, 10 ** 6, OBJECTIVES["sum"], 0.0))
    finally:
        executor.shutdown()
    assert threads == [caller]
    assert slots.tries == 0


def test_two_tiles_compute_at_the_same_time():
    """Each of the first two chunks waits for the other: only two lanes at once get past."""
    barrier = threading.Barrier(2, timeout=WAIT_S)
    slots = CountingSlots(2)
    own = slots.try_acquire()
    executor = LocalExecutor(slots, slots_per_request=2)

    def chunk(k):
        if k < 2:
            barrier.wait()
        return k

    try:
        assert list(executor.map_chunks(chunk, range(6))) == list(range(6))
    finally:
        executor.shutdown()
        own.release()
    assert not barrier.broken


def test_the_cap_bounds_the_slots_one_request_takes():
    slots = CountingSlots(5)
    own = slots.try_acquire()
    executor = LocalExecutor(slots, slots_per_request=3, threads=4)
    in_flight, most, lock = [0], [0], threading.Lock()

    def chunk(k):
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        threading.Event().wait(0.01)
        with lock:
            in_flight[0] -= 1
        return k

    try:
        assert list(executor.map_chunks(chunk, range(40))) == list(range(40))
    finally:
        executor.shutdown()
        own.release()
    assert slots.grants > 0
    assert slots.most_busy <= 3  # the request's own slot and at most two extras
    assert most[0] <= 3
    assert slots.busy == 0


def test_a_request_arriving_meanwhile_gets_a_slot_at_the_next_tile_boundary():
    """Two slots, one request holding both (its own and an extra, chunk after chunk); another
    request waits for one. It gets the extra when a chunk ends, and from then on the first
    request takes no extra slot: it goes on alone, on its own slot."""
    slots = CountingSlots(2)
    own = slots.try_acquire()
    executor = LocalExecutor(slots, slots_per_request=2)
    computed, state = [], {}
    arrived = threading.Event()

    def other_request():
        slot = slots.acquire(timeout=WAIT_S)
        state["at"], state["grants"] = len(computed), slots.grants
        state["slot"] = slot

    def chunk(k):
        computed.append(k)
        if k == 4 and "thread" not in state:
            state["thread"] = threading.Thread(target=other_request)
            state["thread"].start()
            arrived.set()
        threading.Event().wait(0.005)  # chunks that take a while, so the arrival is mid-request
        return k

    try:
        assert list(executor.map_chunks(chunk, range(200))) == list(range(200))
        state["thread"].join(WAIT_S)
    finally:
        executor.shutdown()
        own.release()
    assert state["slot"] is not None
    assert state["at"] < 200, "the waiting request got a slot only once the first had finished"
    assert slots.grants == state["grants"], "an extra slot was taken while the other request held one"
    state["slot"].release()
    assert slots.busy == 0


def test_closing_early_waits_for_tiles_in_flight_and_gives_their_slots_back():
    slots = CountingSlots(3)
    own = slots.try_acquire()
    executor = LocalExecutor(slots, slots_per_request=3)
    running = []

    def chunk(k):
        running.append(k)
        threading.Event().wait(0.01)
        running.remove(k)
        return k

    try:
        results = executor.map_chunks(chunk, range(50))
        assert next(results) == 0
        results.close()  # a deadline or a gone client stops the request
        assert running == []
        assert slots.busy == 1  # only the request's own
    finally:
        executor.shutdown()
        own.release()


def test_a_failing_tile_raises_in_the_caller_and_frees_the_slots():
    slots = CountingSlots(2)
    executor = LocalExecutor(slots, slots_per_request=2)

    def chunk(k):
        if k == 3:
            raise RuntimeError("chunk 3")
        return k

    try:
        with pytest.raises(RuntimeError, match="chunk 3"):
            list(executor.map_chunks(chunk, range(10)))
    finally:
        executor.shutdown()
    assert slots.busy == 0


def test_tiles_are_cache_sized_only_when_they_may_run_in_parallel():
    assert elements_per_chunk(8 * 1024 * 1024, OBJECTIVES["sum"], 5, 4, parallel=True) == PARALLEL_CHUNK_ELEMENTS
    assert elements_per_chunk(8 * 1024 * 1024, OBJECTIVES["sum"], 5, 4, parallel=False) == 1024 * 1024
    assert elements_per_chunk(1000, OBJECTIVES["sum"], 5, 4, parallel=True) == 1000


def test_slots_per_request_setting():
    assert Settings.from_env({}).slots_per_request is None  # all the pod's slots
    assert Settings.from_env({"BLOCKGRAD_SLOTS_PER_REQUEST": "1"}).slots_per_request == 1
    with pytest.raises(ValueError, match="BLOCKGRAD_SLOTS_PER_REQUEST"):
        Settings.from_env({"BLOCKGRAD_SLOTS_PER_REQUEST": "0"})


def test_closing_pass_one_early_gives_the_extra_slots_back():
    torch.manual_seed(4)
    vectors = torch.randn(64, 4)
    chunks = chunks_of(64, 4, 16, 200)
    slots = CountingSlots(3)
    own = slots.try_acquire()
    executor = LocalExecutor(slots, slots_per_request=3)
    try:
        run = PassOne(executor, vectors, 16, 200, OBJECTIVES["mean"], 0.0)
        first = next(iter(run))
        assert first.chunk == chunks[0]
        run.close()
        assert slots.busy == 1
    finally:
        executor.shutdown()
        own.release()
    assert slots.grants > 0


def test_bench_overlap_counts_only_time_both_intervals_ran():
    from bench.cores import overlap_seconds

    assert overlap_seconds([(0, 2), (3, 4)], [(1, 3.5)]) == 1 + 0.5
    assert overlap_seconds([(0, 1)], [(1, 2)]) == 0
    assert overlap_seconds([], [(0, 1)]) == 0


def test_an_extra_lane_goes_on_from_tile_to_tile_while_the_caller_computes_one():
    """The pool lane does not wait for the calling thread to hand it each chunk: while the
    caller sits in its first chunk, the lane computes every other chunk the window allows
    (LOOKAHEAD_PER_LANE x 2 lanes, less the caller's), giving its slot back between them."""
    from app.core.run import LOOKAHEAD_PER_LANE

    slots = CountingSlots(2)
    own = slots.try_acquire()
    executor = LocalExecutor(slots, slots_per_request=2)
    caller, on_pool, lock = threading.get_ident(), [], threading.Lock()
    started, enough = threading.Event(), threading.Event()
    ahead = 2 * LOOKAHEAD_PER_LANE - 1
    seen = {}

    def chunk(k):
        if threading.get_ident() == caller:
            if not started.is_set():
                started.set()
                seen["ran on its own"] = enough.wait(WAIT_S)
                seen["pool chunks meanwhile"] = len(on_pool)
        else:
            started.wait(WAIT_S)  # the pool's first chunk ends only once the caller is inside one
            with lock:
                on_pool.append(k)
                if len(on_pool) >= ahead:
                    enough.set()
        return k

    try:
        assert list(executor.map_chunks(chunk, range(20))) == list(range(20))
    finally:
        executor.shutdown()
        own.release()
    assert seen["ran on its own"], seen
    assert seen["pool chunks meanwhile"] == ahead  # and no more: the window bounds what is held
    assert slots.grants >= ahead  # a slot taken again at each chunk boundary
    assert slots.busy == 0
