"""Unit tests of app/core that kill mutants the rest of the fast suite let live (`make mutants`,
docs/testing.md). Expected values are literals worked out by hand from the docs' rules, or
tools/reference.py's; the cost model (its measured constants in app/core/admission.py) only where a
prediction is the input."""

import threading
import time
from concurrent.futures import Future

import numpy as np
import pytest
import torch

from app.core.admission import AnswerCost, admit, advice, check_activations, check_block_and_answer, over_the_deadline
from app.core.engine import DEFAULT_CHUNK_ELEMENTS, plan_bands
from app.core.errors import BlockgradError
from app.core.objectives import OBJECTIVES
from app.core.request import GradientRequest, Sizes
from app.core.run import LOOKAHEAD_PER_LANE, MOST_CHUNKS_BETWEEN_TRIES, ChunkRun, LocalExecutor, pass_one, run
from app.core.settings import Settings
from app.core.slots import Deadline, ThreadSlots
from tools.reference import reference_accumulated, reference_blocks

from .numeric import assert_matches


def refusal(call, *args) -> BlockgradError:
    with pytest.raises(BlockgradError) as info:
        call(*args)
    assert info.value.code == "limit_exceeded"
    return info.value


# Activations: the largest block's pairs x bytes_per_pair against BLOCKGRAD_MAX_ACTIVATION_BYTES.
# N = 10: factor 2 -> blocks of 5 (25 pairs), 3 -> 3, 3, 4 (16), 4 -> 2, 2, 2, 4 (16),
# 5 -> 2 each (4), 10 -> 1 pair.
@pytest.mark.parametrize("limit", [2500, 10 ** 9])
def test_activations_at_or_under_the_limit_are_admitted(limit):
    sizes = Sizes(10, 2, 2, ("blocks",), bytes_per_pair=100)
    assert check_activations(sizes, Settings(max_activation_bytes=limit)) is None


@pytest.mark.parametrize("limit,fitting", [(2499, 3), (1600, 3), (1599, 5), (400, 5), (399, 10), (100, 10)])
def test_activations_over_the_limit_name_the_smallest_larger_factor_that_fits(limit, fitting):
    sizes = Sizes(10, 2, 2, ("blocks",), bytes_per_pair=100)
    error = refusal(check_activations, sizes, Settings(max_activation_bytes=limit))
    assert error.details == {"limit": "BLOCKGRAD_MAX_ACTIVATION_BYTES", "value": 2500, "allowed": limit}
    assert f"factor {fitting} fits" in error.message and "about 2500 bytes (100 bytes per pair)" in error.message


def test_activations_with_a_remainder_block_count_the_larger_last_block():
    # N = 7, factor 3: blocks of 2, 2 and 3 rows -> the largest holds 9 pairs.
    error = refusal(check_activations, Sizes(7, 1, 3, ("blocks",), bytes_per_pair=10), Settings(max_activation_bytes=89))
    assert (error.details["value"], error.details["allowed"]) == (90, 89)
    # factor 4: 1, 1, 1, 4 rows (16 pairs); 5: 1, 1, 1, 1, 3 (9); 6: last block 2 rows (4 pairs).
    assert "factor 6 fits" in error.message


def test_activations_too_large_for_one_pair():
    error = refusal(check_activations, Sizes(10, 2, 2, ("blocks",), bytes_per_pair=100),
                    Settings(max_activation_bytes=99))
    assert error.details["value"] == 2500 and error.message == (
        "With factor 2 the model's activations for the largest block take about 2500 bytes (100 bytes per "
        "pair), over BLOCKGRAD_MAX_ACTIVATION_BYTES = 99; this model's activations for even one pair are too large.")
    assert "suggested_factor" not in error.details


def test_built_in_objectives_have_no_activation_limit():
    assert check_activations(Sizes(10, 2, 2, ("blocks",)), Settings(max_activation_bytes=0)) is None


# The deadline: admission refuses what the cost model predicts over BLOCKGRAD_REQUEST_TIMEOUT_S.
# With BLOCKGRAD_MAX_BLOCK_ELEMENTS = 2 and D = 1 only 1 x 1 blocks fit (2 numbers each), so the
# only factor that fits N = 4 is 4, whatever the cost model says.
ONLY_FACTOR_4 = dict(max_block_elements=2)


def test_over_the_deadline_suggests_the_factor_that_fits_when_it_meets_the_deadline():
    settings = Settings(request_timeout_s=10.0, **ONLY_FACTOR_4)
    error = over_the_deadline(Sizes(4, 1, 2, ("blocks",)), 12.34567, settings)
    assert error.code == "limit_exceeded"
    assert error.details == {"limit": "BLOCKGRAD_REQUEST_TIMEOUT_S", "value": 12.346, "allowed": 10.0,
                             "predicted_s": 12.346, "deadline_s": 10.0, "suggested_factor": 4}
    assert "about 12.3 s" in error.message and "factor 4 is predicted" in error.message


def test_over_the_deadline_without_a_better_factor_suggests_none():
    settings = Settings(request_timeout_s=10.0, **ONLY_FACTOR_4)
    error = over_the_deadline(Sizes(4, 1, 4, ("blocks",)), 12.0, settings)
    assert error.details == {"limit": "BLOCKGRAD_REQUEST_TIMEOUT_S", "value": 12.0, "allowed": 10.0,
                             "predicted_s": 12.0, "deadline_s": 10.0}
    assert error.message == ("This request is predicted to take about 12 s, over the deadline "
                             "BLOCKGRAD_REQUEST_TIMEOUT_S = 10 s; send fewer vectors or ask for fewer outputs.")


# Every cost constant pinned (BLOCKGRAD_COST_PER_BLOCK_S / _PER_NUMBER_S replace compute and
# output costs alike) to powers of two, so the predictions below are exact. The cost model
# (app/core/admission.py; docs/performance.md, "Choosing a factor"):
#   seconds = stages x (blocks x b + numbers x u) + [blocks asked] (blocks x b + N x N x 2D x u)
#   blocks = F x F, numbers = N x N x 2D + F x N x 2D (no block over a 1M-number chunk here);
#   stages = 1: `sum`, the default objective, keeps its gradients from pass one.
PINNED_COSTS = dict(cost_per_block_s=1 / 8, cost_per_number_s=1 / 64)


def test_over_the_deadline_suggests_a_factor_predicted_to_meet_it_exactly():
    """The suggestion's own prediction (factor 4's, not the request's factor 2's) against the deadline."""
    sizes = Sizes(4, 1, 2, ("blocks",))
    # N = 4, D = 1 (2D = 2), blocks asked. Factor 4: blocks 16, numbers 32 + 4 x 4 x 2 = 64:
    #   (16/8 + 64/64) + (16/8 + 32/64) = 3 + 2.5 = 5.5 s.
    # Factor 2 (the request's): blocks 4, numbers 32 + 2 x 4 x 2 = 48:
    #   (4/8 + 48/64) + (4/8 + 32/64) = 1.25 + 1 = 2.25 s, "2.2" against factor 4's "5.5".
    better_s = 5.5
    error = over_the_deadline(sizes, 99.0, Settings(request_timeout_s=better_s, **ONLY_FACTOR_4, **PINNED_COSTS))
    assert error.details["suggested_factor"] == 4
    assert "factor 4 is predicted to take about 5.5 s" in error.message
    slower = over_the_deadline(sizes, 99.0, Settings(request_timeout_s=better_s - 1e-9, **ONLY_FACTOR_4,
                                                     **PINNED_COSTS))
    assert "suggested_factor" not in slower.details  # 5.5 s exactly: a hair under it is too slow


def test_over_the_deadline_does_not_suggest_a_factor_that_is_also_too_slow():
    settings = Settings(request_timeout_s=1e-12, **ONLY_FACTOR_4)
    error = over_the_deadline(Sizes(4, 1, 2, ("blocks",)), 1.0, settings)
    assert "suggested_factor" not in error.details and error.details["deadline_s"] == 1e-12


# N = 64, D = 8 (2D = 16), F = 4: blocks 16, numbers 64 x 64 x 16 + 4 x 64 x 16 = 65,536 + 4,096 = 69,632;
# compute 16/8 + 69,632/64 = 2 + 1,088 = 1,090 s; writing the blocks 16/8 + 65,536/64 = 2 + 1,024 = 1,026 s.
@pytest.mark.parametrize("outputs,predicted", [(("blocks",), 2116.0), (("accumulated", "losses"), 1090.0)])
def test_admit_refuses_past_the_deadline_and_admits_at_it(outputs, predicted):
    sizes = Sizes(64, 8, 4, outputs)
    error = refusal(admit, sizes, AnswerCost(), Settings(request_timeout_s=predicted / 2, **PINNED_COSTS))
    assert error.details["limit"] == "BLOCKGRAD_REQUEST_TIMEOUT_S" and error.details["value"] == predicted
    assert admit(sizes, AnswerCost(), Settings(request_timeout_s=predicted, **PINNED_COSTS)).seconds == predicted


def test_admit_predicts_no_time_for_no_outputs():
    """/v2 asking only for bounds computes nothing: no time, no refusal even at a zero deadline."""
    assert admit(Sizes(64, 8, 4, ()), AnswerCost(), Settings(request_timeout_s=0.0)).seconds == 0.0


# The answer's size: N = 4, D = 3, factor 2 -> blocks 4 * 4 * 6 = 96, accumulated 12, losses 4.
@pytest.mark.parametrize("outputs,total", [(("blocks", "accumulated", "losses"), 112), (("accumulated",), 12)])
def test_an_answer_at_the_output_limit_is_admitted_and_one_over_refused(outputs, total):
    sizes = Sizes(4, 3, 2, outputs)
    assert check_block_and_answer(sizes, Settings(max_output_elements=total)) is None
    error = refusal(check_block_and_answer, sizes, Settings(max_output_elements=total - 1))
    assert (error.details["limit"], error.details["value"], error.details["allowed"]) == (
        "BLOCKGRAD_MAX_OUTPUT_ELEMENTS", total, total - 1)


def test_a_block_at_the_block_limit_is_admitted_and_one_over_refused():
    sizes = Sizes(4, 3, 1, ("accumulated",))  # one block of 4 x 4 x 6 = 96 numbers
    assert check_block_and_answer(sizes, Settings(max_block_elements=96)) is None
    error = refusal(check_block_and_answer, sizes, Settings(max_block_elements=95))
    assert (error.details["limit"], error.details["value"], error.details["allowed"]) == (
        "BLOCKGRAD_MAX_BLOCK_ELEMENTS", 96, 95)


def test_an_answer_over_the_limit_gets_a_factor_only_when_the_losses_are_what_is_over():
    """N = 4, D = 3: accumulated is 12 numbers, losses F x F. With 20 allowed, factor 4 (28) is
    over because of its losses and factors 1 and 2 fit; with 12 allowed no factor can."""
    losses_over = refusal(check_block_and_answer, Sizes(4, 3, 4, ("accumulated", "losses")),
                          Settings(max_output_elements=20))
    assert losses_over.details["value"] == 28 and losses_over.details["suggested_factor"] in {1, 2}
    fixed_over = refusal(check_block_and_answer, Sizes(4, 3, 2, ("accumulated", "losses")),
                         Settings(max_output_elements=12))
    assert fixed_over.details == {"limit": "BLOCKGRAD_MAX_OUTPUT_ELEMENTS", "value": 16, "allowed": 12}
    assert fixed_over.message == (
        "The answer would hold 16 numbers, over BLOCKGRAD_MAX_OUTPUT_ELEMENTS = 12; ask for fewer outputs "
        "(for example only accumulated and losses) or send fewer vectors.")


# Advice when no factor fits: one pair of D = 3 is 6 numbers; N = 4 x D = 3 of accumulated is 12.
def test_advice_when_even_one_pair_is_over_the_block_limit():
    sizes = Sizes(4, 3, 1, ("accumulated",))
    assert advice(sizes, Settings(max_block_elements=5)) == ("send shorter vectors: even one pair is too large", {})


def test_advice_when_one_pair_fits_exactly_but_the_answer_never_does():
    sizes = Sizes(4, 3, 1, ("accumulated",))
    assert advice(sizes, Settings(max_block_elements=6, max_output_elements=11)) == (
        "no factor fits every limit with outputs accumulated: ask for fewer outputs (for example only "
        "accumulated and losses) or send fewer vectors", {})


# first_non_finite_block: which block a non_finite_result names. In float32, sum_of_squares
# overflows on any block holding a row of 3e38 (its loss and its gradient 2 * 3e38).
def overflowing(n: int, factor: int, row: int) -> tuple[GradientRequest, torch.Tensor]:
    vectors = np.ones((n, 1), dtype=np.float32)
    vectors[row] = 3e38
    req = GradientRequest(vectors, factor, "sum_of_squares", 0.0, ("blocks",), "float32")
    return req, torch.as_tensor(vectors)


def named_block(req: GradientRequest, vectors: torch.Tensor, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> dict:
    with pytest.raises(BlockgradError) as info:
        pass_one(req, torch.device("cpu"), vectors, Deadline(60.0), 0, chunk_elements)
    assert info.value.code == "non_finite_result"
    return info.value.details["block"]


def test_the_first_non_finite_block_may_be_in_a_bands_second_chunk():
    """N = 5, factor 4: blocks of 1, 1, 1 and 2 rows; a band's first chunk holds columns 0-2,
    its second the wider column 3. Row 4 (in block 3) overflows: the first such block,
    row-block-major, is (0, 3), in the first band's second chunk."""
    assert named_block(*overflowing(5, 4, row=4)) == {"row": 0, "col": 3}


def test_a_finite_block_in_a_suspect_chunk_is_not_named():
    """Row 2 overflows (block 2 of 4): in the chunk of the first block row, (0, 0) and (0, 1)
    are finite and (0, 2) is not; one block per chunk or the whole row in one, the same block."""
    req, vectors = overflowing(4, 4, row=2)
    assert named_block(req, vectors) == {"row": 0, "col": 2}
    assert named_block(req, vectors, chunk_elements=1) == {"row": 0, "col": 2}


# pass one keeps blocks while their gradients fit keep_bytes, else lets them go and recomputes
# them from the vectors when written. N = 6, factor 2, D = 2, sum_of_squares in
# float64: one chunk of 2 x 2 blocks of 3 x 3 x 4 gradients, 144 numbers, 1152 bytes.
GRADIENT_BYTES = 144 * 8


@pytest.mark.parametrize("keep_bytes,kept", [(GRADIENT_BYTES, True), (GRADIENT_BYTES - 1, False)])
def test_pass_one_keeps_blocks_within_the_budget_and_recomputes_them_past_it(keep_bytes, kept):
    vectors = np.random.default_rng(27).standard_normal((6, 2))
    req = GradientRequest(vectors, 2, "sum_of_squares", 0.0, ("blocks", "accumulated"), "float64")
    tensor = torch.as_tensor(vectors)
    assert len([chunk for band in plan_bands(6, 2, 2, DEFAULT_CHUNK_ELEMENTS) for chunk in band]) == 1
    result = pass_one(req, torch.device("cpu"), tensor, Deadline(60.0), keep_bytes, DEFAULT_CHUNK_ELEMENTS)
    assert (result.kept is not None) == kept
    blocks = list(result.blocks())
    expected = reference_blocks(tensor, 2, "sum_of_squares", offset=0.0)
    assert [(b.r, b.c, b.row_span, b.col_span) for b in blocks] == [
        (0, 0, (0, 3), (0, 3)), (0, 1, (0, 3), (3, 6)), (1, 0, (3, 6), (0, 3)), (1, 1, (3, 6), (3, 6))]
    for block, (loss, gradient) in zip(blocks, expected, strict=True):
        assert_matches(block.loss, loss, "float64")
        assert_matches(block.gradient, gradient, "float64")
    assert_matches(result.accumulated, reference_accumulated(tensor, 2, "sum_of_squares", offset=0.0), "float64")


# Which block a tile's or a whole matrix's non_finite_result names when only a gradient is
# not finite (every loss finite): found through the rows_sum or the cols_sum share alone.
# sqrt's gradient at 0 is infinite: "rows" takes the root of each pair's row-vector half
# (2D = [v_i, v_j]), so every block of the zero vector's block row is non-finite in dL/dV of
# its rows only; "cols" the column half, every block of that block column, in its columns'.
class RootOfHalf:
    description = "sqrt of one half of each pair, summed (a test objective)"

    def __init__(self, half: str):
        self.name, self.half = f"root_of_{half}", half

    def losses(self, blocks: torch.Tensor, offset: float) -> torch.Tensor:
        dim = blocks.shape[-1] // 2
        part = blocks[..., :dim] if self.half == "rows" else blocks[..., dim:]
        return torch.sqrt(part).sum(dim=(1, 2, 3))  # (k,)

    def reference(self, block: torch.Tensor, offset: float) -> torch.Tensor:  # tools/reference.py's form
        return self.losses(block[None], offset)[0]


def first_bad_by_reference(vectors, factor, objective, rows, cols):
    """The oracle: tools/reference.py's independent per-block loops, row-block-major."""
    blocks = reference_blocks(vectors, factor, objective.name, offset=0.0,
                              objectives={objective.name: objective.reference})
    return min(((r, c) for r in rows for c in cols
                if not (torch.isfinite(blocks[r * factor + c][0]) and torch.isfinite(blocks[r * factor + c][1]).all())),
               default=None)


# N = 4, factor 4 (1 x 1 blocks), one block per chunk (chunk_elements = 1); vector `zero` is 0.
@pytest.mark.parametrize("half,zero,rows,cols,expected", [
    ("rows", 2, None, None, (2, 0)),  # the whole matrix: row 2 of blocks, found by rows_sum
    ("cols", 2, None, None, (0, 2)),  # column 2 of blocks, found by cols_sum (the same tensor)
    ("rows", 3, range(2, 4), range(0, 4), (3, 0)),  # a tile at origin (2, 0): its own rows_sum
    ("cols", 2, range(1, 3), range(1, 4), (1, 2)),  # a tile at origin (1, 1): its own cols_sum
])
def test_the_first_non_finite_block_is_found_from_a_gradient_sum_alone(half, zero, rows, cols, expected):
    from app.core.run import PassOne, SerialExecutor

    vectors = torch.ones(4, 1, dtype=torch.float64)
    vectors[zero] = 0.0
    objective = RootOfHalf(half)
    assert first_bad_by_reference(vectors, 4, objective, rows or range(4), cols or range(4)) == expected
    computed = PassOne(SerialExecutor(), vectors, 4, 1, objective, 0.0, rows, cols)
    list(computed)
    assert torch.isfinite(computed.losses).all()  # every loss finite: only a sum shows it
    assert not computed.surely_finite()
    assert computed.first_non_finite_block() == expected


# The lanes' scheduling (app/core/run.py's ChunkRun), made deterministic: a pool that
# runs a submitted lane only when the test says so, and slots that count what was asked.
WAIT_S = 60.0  # bounds on every wait; never reached unless something is broken


class HeldFuture(Future):
    """A lane's future that tells when someone tried to cancel it (ChunkRun.stop does, after
    marking the run stopped)."""

    def __init__(self):
        super().__init__()
        self.cancel_tried = threading.Event()

    def cancel(self):
        cancelled = super().cancel()
        if cancelled:  # what the pool's thread does when it reaches a cancelled lane
            self.set_running_or_notify_cancel()
        self.cancel_tried.set()
        return cancelled


class ManualPool:
    """ThreadPoolExecutor's submit, but a lane runs only when `run_next` is called."""

    def __init__(self):
        self.pending, self.ran = [], []

    def submit(self, fn, *args):
        future = HeldFuture()
        self.pending.append((future, fn, args))
        return future

    def run_next(self):
        future, fn, args = self.pending.pop(0)
        self.ran.append(future)
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)


class CountedSlots(ThreadSlots):
    """ThreadSlots that count grants and note, at each try, how many chunks had been computed
    and how many results the consumer had taken (`computed`, `taken`: the test's lists).
    Tries after the first `grant_first` are refused, as when all the pod's slots are busy;
    `fail_at` makes that try raise (the pod's slots failing)."""

    def __init__(self, count: int, computed: list, taken: list, grant_first: int | None = None,
                 fail_at: int | None = None):
        super().__init__(count)
        self.computed, self.taken, self.grant_first, self.fail_at = computed, taken, grant_first, fail_at
        self.tries_at, self.grants = [], 0

    def try_acquire(self):
        self.tries_at.append((len(self.computed), len(self.taken)))
        if len(self.tries_at) == self.fail_at:
            raise SlotsFailed()
        refused = self.grant_first is not None and len(self.tries_at) > self.grant_first
        slot = None if refused else super().try_acquire()
        self.grants += slot is not None
        return slot


class SlotsFailed(Exception):
    pass


def consume(results, taken: list) -> None:
    for value in results:
        taken.append(value)


@pytest.mark.parametrize("count,by_lane,tries_at", [
    # 10 chunks: the lane computes 1-4 (the window); once the consumer has taken 2 results
    # the window has room again and a lane is started (on the manual pool: never run).
    (10, [1, 2, 3, 4], [(0, 0), (2, 1), (3, 1), (4, 1), (5, 1), (5, 2)]),
    # 4 chunks: the lane computes 1-3, the last; with every chunk claimed no lane is started.
    (4, [1, 2, 3], [(0, 0), (2, 1), (3, 1), (4, 1)]),
])
def test_a_pool_lane_computes_the_window_ahead_giving_its_slot_back_at_each_chunk(count, by_lane, tries_at):
    """Two lanes: the window is LOOKAHEAD_PER_LANE x 2 = 4 chunks claimed ahead of the
    consumer. The caller computes chunk 0 and hands it over; the pool lane then computes the
    next chunks up to the window or the end; at each chunk boundary it gives its slot back
    and takes one again."""
    assert LOOKAHEAD_PER_LANE == 2
    computed, taken, pool = [], [], ManualPool()
    slots = CountedSlots(1, computed, taken)  # one extra slot (the caller's own is not from here)
    run = ChunkRun(lambda k: computed.append(k) or 10 * k, range(count), 2, slots, pool)
    results = run.results()
    taken.append(next(results))
    assert computed == [0] and len(pool.pending) == 1 and slots.busy == 1  # the lane took the slot
    pool.run_next()
    assert computed == [0] + by_lane
    assert slots.grants == len(by_lane) + 1  # to start, then after each chunk
    assert slots.busy == 0  # given back when no chunk could be claimed
    consume(results, taken)
    assert taken == [10 * k for k in range(count)]
    assert computed == list(range(count))  # each chunk computed once, the rest by the caller
    assert slots.tries_at == tries_at
    started_again = count > len(by_lane) + 1
    assert len(pool.pending) == started_again and slots.busy == started_again
    run.stop()  # a lane that never ran gives its slot back
    assert slots.busy == 0 and all(future.cancelled() for future, _, _ in pool.pending)


@pytest.mark.parametrize("grant_first,tries_at", [
    (0, [0, 1, 3, 7, 15, 31, 47, 63]),  # gaps 1, 2, 4, 8, 16, 16, 16
    # The first try granted (its lane computes chunk 1, then finds no slot): the gaps start
    # again at 1.
    (1, [0, 1, 1, 2, 4, 8, 16, 32, 48]),
])
def test_while_no_slot_is_free_a_request_tries_again_after_1_2_4_up_to_16_chunks(grant_first, tries_at):
    computed, taken, pool = [], [], ManualPool()
    slots = CountedSlots(1, computed, taken, grant_first=grant_first)
    results = ChunkRun(lambda k: computed.append(k) or k, range(64), 2, slots, pool).results()
    taken.append(next(results))
    if grant_first:
        pool.run_next()
        assert computed == [0, 1] and slots.busy == 0
    consume(results, taken)
    assert taken == list(range(64))
    assert MOST_CHUNKS_BETWEEN_TRIES == 16
    assert [at for _, at in slots.tries_at] == tries_at  # results taken at each try


def test_a_lane_whose_slots_fail_ends_with_that_error_and_is_started_again():
    """The pod's slots raise when the lane asks for one at a chunk boundary: the lane ends
    with that error (not another raised while cleaning up), having given its slot back, and
    the request goes on: the lane is idle again and started on a later chunk."""
    computed, taken, pool = [], [], ManualPool()
    slots = CountedSlots(1, computed, taken, fail_at=2)
    results = ChunkRun(lambda k: computed.append(k) or k, range(10), 2, slots, pool).results()
    taken.append(next(results))
    pool.run_next()
    assert isinstance(pool.ran[0].exception(), SlotsFailed)
    assert computed == [0, 1] and slots.busy == 0
    consume(results, taken)
    assert taken == list(range(10))
    assert slots.tries_at[:3] == [(0, 0), (2, 1), (2, 1)]  # the lane's failed try, then the consumer's


def test_a_stopped_run_claims_no_more_chunks_and_its_lane_gives_its_slot_back():
    """A pool lane inside chunk 1 when the request stops (a deadline, a gone client): it ends
    that chunk and claims no other, though the window would allow chunks 2-4; stop() waits for
    it, and every slot is given back."""
    computed, pool = [], ManualPool()
    slots = CountedSlots(1, computed, [])
    inside, go = threading.Event(), threading.Event()

    def chunk(k):
        computed.append(k)
        if k == 1:
            inside.set()
            assert go.wait(WAIT_S), "chunk 1 was never let go"
        return k

    run = ChunkRun(chunk, range(10), 2, slots, pool)
    results = run.results()
    assert next(results) == 0
    future = pool.pending[0][0]
    lane = threading.Thread(target=pool.run_next)
    lane.start()
    assert inside.wait(WAIT_S), "the pool lane never started chunk 1"
    stopper = threading.Thread(target=run.stop)
    stopper.start()
    assert future.cancel_tried.wait(WAIT_S), "stop() never reached the lane"  # the run is marked stopped
    go.set()
    stopper.join(WAIT_S)
    lane.join(WAIT_S)
    assert not stopper.is_alive() and not lane.is_alive()
    assert future.done() and future.exception() is None
    assert computed == [0, 1]
    assert slots.busy == 0


def test_a_shut_down_executor_refuses_chunks_and_gives_the_slot_it_took_back():
    slots = ThreadSlots(2)
    executor = LocalExecutor(slots, slots_per_request=2)
    executor.shutdown()
    with pytest.raises(RuntimeError):
        list(executor.map_chunks(lambda k: k, range(4)))
    assert slots.busy == 0


def test_slots_per_request_below_one_is_refused_and_one_is_serial():
    with pytest.raises(ValueError, match="^slots_per_request must be at least 1$"):
        LocalExecutor(ThreadSlots(2), slots_per_request=0)
    serial = LocalExecutor(ThreadSlots(2), slots_per_request=1)
    assert (serial.parallel, serial.most_lanes) == (False, 1)  # chunks not cache-sized, no pool
    parallel = LocalExecutor(ThreadSlots(2), slots_per_request=2)
    try:
        assert (parallel.parallel, parallel.most_lanes) == (True, 2)
    finally:
        parallel.shutdown()


def meet(parties: int):
    """A chunk function whose first chunks wait for each other: they pass only if `parties`
    of them compute at the same time (else the barrier breaks after WAIT_S and the test fails)."""
    barrier = threading.Barrier(parties, timeout=WAIT_S)

    def chunk(k):
        if k < 2 or (parties == 3 and k < 3):
            barrier.wait()
        return k
    return chunk, barrier


def test_three_slots_per_request_run_three_lanes_at_once_on_the_default_pool():
    slots = ThreadSlots(3)
    own = slots.try_acquire()
    executor = LocalExecutor(slots, slots_per_request=3)  # default pool: 2 threads
    chunk, barrier = meet(3)
    try:
        assert list(executor.map_chunks(chunk, range(8))) == list(range(8))
    finally:
        executor.shutdown()
        own.release()
    assert not barrier.broken and slots.busy == 0


def test_the_pool_has_the_threads_asked_for_two_requests_at_once():
    """threads=2 with 2 slots per request: two requests, each with one pool lane, at once."""
    slots = ThreadSlots(4)
    executor = LocalExecutor(slots, slots_per_request=2, threads=2)
    chunk, barrier = meet(4)
    answers = {}

    def request(name):
        own = slots.acquire(WAIT_S)
        try:
            answers[name] = list(executor.map_chunks(chunk, range(6)))
        finally:
            own.release()

    threads = [threading.Thread(target=request, args=(name,)) for name in "ab"]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(2 * WAIT_S)
    finally:
        executor.shutdown()
    assert answers == {"a": list(range(6)), "b": list(range(6))}
    assert not barrier.broken and slots.busy == 0


# run(): the deadline it is given, the executor's lanes and chunk size on the CPU, the blocks
# kept within BLOCKGRAD_MAX_BLOCK_ELEMENTS' bytes.
ON_CPU = dict(device="cpu")


def test_run_keeps_the_deadline_it_is_given():
    """The deadline started at the request's arrival, not a fresh one of BLOCKGRAD_REQUEST_TIMEOUT_S."""
    req = GradientRequest(np.ones((4, 1)), 2, "sum", 0.0, ("accumulated",), "float64")
    expired = Deadline(5.0, started=time.monotonic() - 3600.0)  # arrived an hour ago
    with pytest.raises(BlockgradError) as info:
        run(req, Settings(request_timeout_s=60.0, **ON_CPU), expired)
    assert info.value.code == "deadline_exceeded" and info.value.details == {"timeout_s": 5.0}


@pytest.mark.parametrize("lanes,chunk_elements", [(2, 256 * 1024), (1, 1024 * 1024)])
def test_run_sizes_chunks_for_the_cache_only_when_lanes_may_run_side_by_side(lanes, chunk_elements):
    """docs/cores.md: chunks of 256 Ki numbers when they may run in parallel, else 1 Mi
    (BLOCKGRAD_MAX_BLOCK_ELEMENTS' default, 4 Mi, is larger than both)."""
    executor = LocalExecutor(ThreadSlots(2), slots_per_request=lanes)
    req = GradientRequest(np.ones((4, 1)), 2, "sum", 0.0, ("accumulated",), "float64")
    try:
        result = run(req, Settings(**ON_CPU), executor=executor)
    finally:
        executor.shutdown()
    assert result.chunk_elements == chunk_elements


def test_run_computes_on_the_executors_lanes_on_the_cpu():
    """N = 8, D = 1, factor 4 (2 x 2 blocks of 8 numbers, 32 per block row), chunks of at most
    BLOCKGRAD_MAX_BLOCK_ELEMENTS = 64 numbers: two chunks, so a second lane starts on the
    free slot (taken at once: nobody waits for it)."""
    computed, taken = [], []
    slots = CountedSlots(2, computed, taken)
    own = slots.acquire(WAIT_S)
    executor = LocalExecutor(slots, slots_per_request=2)
    vectors = np.random.default_rng(28).standard_normal((8, 1))
    req = GradientRequest(vectors, 4, "sum_of_squares", 0.0, ("accumulated", "losses"), "float64")
    try:
        result = run(req, Settings(max_block_elements=64, **ON_CPU), executor=executor)
    finally:
        executor.shutdown()
        own.release()
    assert slots.grants >= 1 and slots.busy == 0
    tensor = torch.as_tensor(vectors)
    assert_matches(result.accumulated, reference_accumulated(tensor, 4, "sum_of_squares", offset=0.0), "float64")


@pytest.mark.parametrize("max_block_elements,kept", [(144, True), (143, False)])
def test_run_keeps_blocks_within_the_bytes_of_one_largest_block(max_block_elements, kept):
    """N = 6, factor 2, D = 2, sum_of_squares in float64: 4 blocks of 3 x 3 x 4 gradients,
    144 numbers, 1152 bytes in all. 144 allowed numbers are 1152 bytes: all kept. With 143
    (1144 bytes) a chunk holds one block row (72 numbers): the second band passes the
    budget and the blocks are let go (recomputed when written)."""
    vectors = np.random.default_rng(27).standard_normal((6, 2))
    req = GradientRequest(vectors, 2, "sum_of_squares", 0.0, ("blocks", "accumulated"), "float64")
    result = run(req, Settings(max_block_elements=max_block_elements, **ON_CPU))
    assert (result.kept is not None) == kept
    expected = reference_blocks(torch.as_tensor(vectors), 2, "sum_of_squares", offset=0.0)
    for block, (loss, gradient) in zip(result.blocks(), expected, strict=True):
        assert_matches(block.loss, loss, "float64")
        assert_matches(block.gradient, gradient, "float64")


def test_losses_whose_total_overflows_are_not_a_non_finite_result():
    """float32, sum_of_squares, N = 2, D = 1, v = 1.3e19, factor 2: each block's loss,
    v^2 + v^2 = 3.38e38, is under float32's 3.40e38, their total is not; every gradient
    (2v) and dL/dV (8v) is finite. The answer is a 200, not a non_finite_result."""
    vectors = np.full((2, 1), 1.3e19, dtype=np.float32)
    req = GradientRequest(vectors, 2, "sum_of_squares", 0.0, ("accumulated", "losses"), "float32")
    result = pass_one(req, torch.device("cpu"), torch.as_tensor(vectors), Deadline(60.0), 0)
    wide = torch.as_tensor(vectors).to(torch.float64)
    expected = torch.stack([loss for loss, _ in reference_blocks(wide, 2, "sum_of_squares", offset=0.0)])
    assert not torch.isfinite(result.losses.sum())  # the total overflows
    assert_matches(result.losses.flatten(), expected, "float32")
    assert_matches(result.accumulated, reference_accumulated(wide, 2, "sum_of_squares", offset=0.0), "float32")


@pytest.mark.parametrize("chunk_elements", [1, DEFAULT_CHUNK_ELEMENTS])
def test_tiles_shares_add_up_to_the_accumulated_gradient(chunk_elements):
    """A job's tiles (2 x 2 tiles of a factor-4 matrix, N = 9: blocks of 2, 2, 2 and 3 rows):
    each tile's losses are its own blocks', and its rows_sum / cols_sum shares, added into
    V's rows and columns of the tile, give tools/reference.py's accumulated gradient."""
    from app.core.engine import block_bounds
    from app.core.run import PassOne, SerialExecutor

    vectors = torch.as_tensor(np.random.default_rng(29).standard_normal((9, 2)))
    bounds = block_bounds(9, 4)
    assert bounds == [0, 2, 4, 6, 9]
    blocks = reference_blocks(vectors, 4, "sum_of_squares", offset=0.0)
    accumulated = torch.zeros_like(vectors)
    for rows in (range(0, 2), range(2, 4)):
        for cols in (range(0, 2), range(2, 4)):
            tile = PassOne(SerialExecutor(), vectors, 4, chunk_elements, OBJECTIVES["sum_of_squares"], 0.0, rows, cols)
            list(tile)
            assert tile.surely_finite()
            for i, r in enumerate(rows):
                for j, c in enumerate(cols):
                    assert_matches(tile.losses[i, j], blocks[r * 4 + c][0], "float64")
            accumulated[bounds[rows.start]:bounds[rows.stop]] += tile.rows_sum
            accumulated[bounds[cols.start]:bounds[cols.stop]] += tile.cols_sum
    assert_matches(accumulated, reference_accumulated(vectors, 4, "sum_of_squares", offset=0.0), "float64")


class ClosableExecutor:
    """Serial, but tells whether pass one closed its chunks' iterator (what stops the lanes)."""
    parallel, most_lanes, closed = False, 1, False

    def map_chunks(self, fn, chunks):
        try:
            yield from map(fn, chunks)
        finally:
            self.closed = True


def test_closing_pass_one_closes_the_executors_iterator():
    from app.core.run import PassOne

    executor = ClosableExecutor()
    computed = PassOne(executor, torch.ones(4, 1), 4, 1, OBJECTIVES["sum"], 0.0)
    next(iter(computed))
    assert not executor.closed
    computed.close()
    assert executor.closed


def test_run_sizes_chunks_for_an_objectives_activations():
    """An objective declaring 48 bytes of activations per pair (a model's): with D = 1 in
    float64 a pair is 16 bytes, so a chunk holds 16 / (16 + 48) of the default 1 Mi numbers."""
    class Activations:
        name, description, bytes_per_pair = "sum", "sum with 48 bytes of activations per pair", 48

        def losses(self, blocks, offset):
            return OBJECTIVES["sum"].losses(blocks, offset)

    req = GradientRequest(np.ones((4, 1)), 2, "sum", 0.0, ("accumulated",), "float64", objective_fn=Activations())
    assert run(req, Settings(**ON_CPU)).chunk_elements == 256 * 1024


def test_a_non_finite_result_names_the_requests_dtype():
    """The block's message names float32 and suggests float64 (docs/errors.md's advice)."""
    req, vectors = overflowing(4, 4, row=2)
    with pytest.raises(BlockgradError) as info:
        pass_one(req, torch.device("cpu"), vectors, Deadline(60.0), 0)
    assert info.value.message == ("Block (row 0, col 2) has a loss or gradient that is not finite in float32; "
                                  "send smaller values, another objective, or dtype float64.")


def test_an_accumulated_gradient_that_overflows_with_every_block_finite():
    """loss = 1e38 x sum(B): every block's loss and gradient (1e38) is finite in float32, but
    each entry of dL/dV adds 2 x N = 4 of them: 4e38, over float32's 3.4e38."""
    class Steep:
        name, description = "steep", "1e38 x sum(B)"

        def losses(self, blocks, offset):
            return (blocks * 1e38).sum(dim=(1, 2, 3))

    vectors = np.full((2, 1), 1e-6, dtype=np.float32)
    req = GradientRequest(vectors, 2, "sum", 0.0, ("accumulated",), "float32", objective_fn=Steep())
    with pytest.raises(BlockgradError) as info:
        pass_one(req, torch.device("cpu"), torch.as_tensor(vectors), Deadline(60.0), 0)
    assert (info.value.code, info.value.details) == ("non_finite_result", {"output": "accumulated"})
    assert info.value.message == ("The accumulated gradient is not finite in float32; "
                                  "send smaller values, another objective, or dtype float64.")
