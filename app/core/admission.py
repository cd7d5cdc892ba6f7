"""Admission: from a request's sizes alone, before any number is converted, what it will
cost in seconds and bytes, and the verdict: admitted, or a refusal that names the limit
and what to change; then the worker's ledger, which holds the predicted bytes.

`admit` is the one call. It checks, in order: N and D; the largest block; the whole answer;
a model objective's activations; the predicted seconds against the deadline (the cost
model, at one compute slot); and predicts the peak bytes (at the most slots the request
may take), which the caller reserves in the ledger. A refusal that a factor would cure
carries details.suggested_factor. The deadline is still checked between blocks: the cost
model is an estimate.

The cost model: predicted seconds from the sizes alone,

time = stages x (blocks x cost per block + numbers x cost per number)
     + (answer with blocks) x (blocks x output per block + entries x output per number)

with blocks = F x F, entries = N x N x 2D (every block's entries) and numbers = entries +
F x N x 2D: the engine also writes each block's row and column sums for the chain rule,
(h + w) x D numbers a block, which is what makes many small blocks dearer than a few
large ones; and the entries of blocks larger than a chunk (1M numbers) count twice, as
they run out of cache (`engine_work`). Pass one is one stage; asking for the blocks adds
pass two when their gradients cannot be kept from pass one (dense gradients over the keep
budget, app/core/run.py), and the output terms (taking each block apart and writing it as
JSON, /v1's slower encoding). The constants come from `python -m bench.costs` (least
squares on relative error; how and how far off they are: docs/benchmarks.md). They are one
machine's CPU; a faster CPU (or a GPU) is overpredicted. BLOCKGRAD_COST_PER_BLOCK_S and
BLOCKGRAD_COST_PER_NUMBER_S, when set, replace every constant (compute and output) so that
a test's verdict never depends on the machine.

The peak memory: `predict_peak_bytes` adds up what a request holds at its peak, from its
sizes and the front end's `AnswerCost` alone: its body and the parsed input, the engine's
working set (a chunk of at most BLOCKGRAD_MAX_BLOCK_ELEMENTS numbers and what the objective
derives from it, blocks kept between the passes; on k compute slots, k chunks in flight
and the chunks computed ahead: `working_set_bytes`), and the answer as the front end
writes it (whole arrays, text a block or a slice at a time). A request is predicted for
the most slots it may take (its reservation is never resized while it runs). The
coefficients are measured, not guessed: `python -m bench.memory` runs each case on a fresh
gunicorn worker and prints the measured peak beside this prediction (docs/benchmarks.md,
"Peak worker memory per case"); each coefficient is the largest measured per-unit cost,
rounded up.

`MemoryLedger` is the worker's account: the bytes reserved by the requests it holds
(computing, queued, bodies being parsed). A request is admitted when its prediction plus
what is reserved fits BLOCKGRAD_WORKER_MEMORY_BYTES; a prediction over the budget alone is
`limit_exceeded` (413), one that only the current load keeps out is `memory_busy` (503,
Retry-After). A body is reserved for as it arrives, never for what its Content-Length
declares: `upload_bytes` of what has arrived while it is still arriving,
`body_parse_bytes` once it is complete. Bodies still arriving (uploads) together hold at
most BLOCKGRAD_UPLOAD_MEMORY_SHARE of the budget, so that clients sending slowly can hold
back other uploads, never a request whose body has arrived.
"""
import itertools
import threading
from dataclasses import dataclass, replace
from types import SimpleNamespace

from .dtypes import DTYPES, WIDEST
from .engine import (DEFAULT_CHUNK_ELEMENTS, PARALLEL_CHUNK_ELEMENTS, elements_per_chunk, plan_bands, shape_groups)
from .errors import (limit_exceeded, memory_busy, memory_limit_exceeded, too_long_vectors, too_many_vectors,
                     upload_limit_exceeded, uploads_busy)
from .heap import TRIM_SLACK_BYTES, untrimmed_growth
from .request import Sizes
from .run import LOOKAHEAD_PER_LANE
from .settings import Settings

# (objective, dtype) -> (seconds per block, seconds per number) of pass one.
COMPUTE_COSTS: dict[tuple[str, str], tuple[float, float]] = {
    ("sum", "float32"): (5.74e-09, 8.46e-10),
    ("sum", "float64"): (1.61e-09, 1.44e-09),
    ("mean", "float32"): (2.42e-08, 1.14e-09),
    ("mean", "float64"): (1.93e-08, 2.28e-09),
    ("sum_of_squares", "float32"): (2.33e-08, 2.30e-09),
    ("sum_of_squares", "float64"): (4.33e-09, 5.32e-09),
    ("l2_norm", "float32"): (1.77e-08, 1.85e-09),
    ("l2_norm", "float64"): (2.07e-09, 4.49e-09),
    ("logsumexp", "float32"): (1.25e-08, 2.39e-09),
    ("logsumexp", "float64"): (0.00e+00, 5.49e-09),
}
# An objective not in the table (a model-backed one) is charged as the dearest built-in.
UNKNOWN_OBJECTIVE = (max(c[0] for c in COMPUTE_COSTS.values()), max(c[1] for c in COMPUTE_COSTS.values()))
# dtype -> (seconds per block, seconds per number) of taking the blocks apart and writing them as JSON.
OUTPUT_COSTS: dict[str, tuple[float, float]] = {"float32": (1.2e-05, 2.0e-08), "float64": (1.4e-05, 4.1e-08)}
# Objectives whose gradient is a view of one number per block: pass one always keeps them.
SCALAR_GRADIENTS = frozenset({"sum", "mean"})


def measured_or_set(costs: tuple[float, float], settings: Settings) -> tuple[float, float]:
    """(seconds per block, seconds per number): the table's, or the settings' where set."""
    return tuple(measured if set_ is None else set_
                 for measured, set_ in zip(costs, (settings.cost_per_block_s, settings.cost_per_number_s)))


def engine_work(n: int, dim: int, factor: int) -> tuple[int, int]:
    """(blocks, numbers) of one engine pass: numbers are the blocks' entries plus their
    row and column sums, plus once more the entries of blocks larger than a chunk (such a
    block is a chunk alone and its tensors fall out of cache)."""
    pair = 2 * dim
    groups = [(len(indices), side) for indices, side in shape_groups(n, factor)]
    oversized = sum(count_h * count_w * h * w * pair
                    for count_h, h in groups for count_w, w in groups
                    if h * w * pair > DEFAULT_CHUNK_ELEMENTS)
    return factor * factor, n * n * pair + factor * n * pair + oversized


def predict_seconds(sizes: Sizes, settings: Settings) -> float:
    """Predicted seconds of computing (and, for blocks, writing) the answer on this machine's CPU."""
    n, dim, objective, dtype = sizes.n, sizes.dim, sizes.objective, sizes.dtype
    blocks, numbers = engine_work(n, dim, sizes.factor)
    per_block, per_number = measured_or_set(COMPUTE_COSTS.get((objective, dtype), UNKNOWN_OBJECTIVE), settings)
    stages, seconds = 1, 0.0
    if "blocks" in sizes.outputs:
        # Pass two recomputes the blocks when their gradients are dense and past the keep budget.
        stages += objective not in SCALAR_GRADIENTS and n * n * 2 * dim > settings.max_block_elements
        out_block, out_number = measured_or_set(OUTPUT_COSTS.get(dtype, OUTPUT_COSTS["float64"]), settings)
        seconds += blocks * out_block + n * n * 2 * dim * out_number
    return seconds + stages * (blocks * per_block + numbers * per_number)


# Parsed JSON input per number: a Python float (24 B), its list slot (8 B), the float64
# matrix it becomes (8 B), and the rows' lists.
JSON_INPUT_BYTES_PER_NUMBER = 56
# The engine's working set, in chunks of its numbers: the pair stack, its gradient, the
# objective's intermediates, the chain-rule sums; a band holds at most two chunks' results.
CHUNKS_IN_FLIGHT = {"sum": 3, "mean": 3, "sum_of_squares": 4, "l2_norm": 5, "logsumexp": 6}
DEFAULT_CHUNKS_IN_FLIGHT = 6
FIXED_BYTES = 24 * 1024 * 1024  # allocator and interpreter overhead of any computing request
MARGIN = 1.5  # run-to-run noise, and cases between the measured ones


@dataclass(frozen=True)
class AnswerCost:
    """How a front end reads its request and writes its answer, in bytes held per number,
    for the prediction. Each front end describes its own (e.g. /v1: JSON text a block at a
    time; /v2: tensors made a block row at a time)."""
    body_bytes: int = 0
    input_per_number: int = JSON_INPUT_BYTES_PER_NUMBER  # the parsed or decoded input, per input number
    block_per_number: int = 0  # per number of the largest block, while it is written
    block_row_per_number: int = 0  # per number of one block row of the N x N x 2D grid
    grid_per_number: int = 0  # per number of the whole grid, when it is held whole
    head_per_number: int = 0  # per number of accumulated and losses
    head_fixed: int = 0  # e.g. a buffer of text


def working_set_bytes(sizes: Sizes, settings: Settings, lanes: int, chunk: int, block: int) -> int:
    """The engine's working set in pass one, for chunks of `chunk` numbers and blocks of at
    most `block`: serially a chunk's (CHUNKS_IN_FLIGHT of its size); on up to `lanes` slots
    the larger of that and, for each lane, a parallel chunk's working set and
    LOOKAHEAD_PER_LANE chunks' results waiting (app/core/run.py). The larger, because a
    request on several lanes may still find no second slot free, and off the CPU runs
    serially with whole chunks."""
    item = DTYPES.get(sizes.dtype, WIDEST).item_bytes
    per_chunk = CHUNKS_IN_FLIGHT.get(sizes.objective, DEFAULT_CHUNKS_IN_FLIGHT)
    serial = per_chunk * chunk * item
    lanes = request_lanes(sizes, settings, lanes)
    if lanes <= 1:  # one slot, or one chunk: inline, as serially
        return serial
    small = max(block, min(PARALLEL_CHUNK_ELEMENTS, chunk))  # a block is never split
    return max(serial, lanes * (per_chunk + LOOKAHEAD_PER_LANE) * small * item)


def request_lanes(sizes: Sizes, settings: Settings, lanes: int) -> int:
    """The most lanes a request may take on `lanes` slots: no more than its chunks as run()
    plans them for several slots (app/core/run.py), so a request of one chunk, which runs
    inline, reserves for one lane only."""
    if lanes <= 1 or not sizes.outputs:
        return 1
    item = DTYPES.get(sizes.dtype, WIDEST).item_bytes
    activations = SimpleNamespace(bytes_per_pair=sizes.bytes_per_pair)  # what elements_per_chunk reads
    chunk = elements_per_chunk(settings.max_block_elements, activations, sizes.dim, item, parallel=True)
    bands = plan_bands(sizes.n, sizes.dim, sizes.factor, chunk)  # lazy: counted up to `lanes` chunks only
    return max(1, sum(1 for _ in itertools.islice(itertools.chain.from_iterable(bands), lanes)))


def predict_peak_bytes(sizes: Sizes, answer: AnswerCost, settings: Settings, lanes: int = 1) -> int:
    """Bytes a request adds to its worker at its peak: its body (and werkzeug's copy while
    reading it), the input, the engine's working set on up to `lanes` compute slots, and the
    answer as `answer` writes it."""
    n, dim, factor, outputs = sizes.n, sizes.dim, sizes.factor, sizes.outputs
    item = DTYPES.get(sizes.dtype, WIDEST).item_bytes
    numbers = n * dim
    grid = n * n * 2 * dim
    total = FIXED_BYTES + 2 * answer.body_bytes + answer.input_per_number * numbers
    total += 3 * numbers * item  # vectors, accumulated, the chain-rule sums onto them
    heap_slack = 0
    side = largest_block_side(n, factor)
    block = side * side * 2 * dim  # numbers of the largest block
    if outputs:
        # A chunk as predicted: at most max_block_elements, at least one block, never more
        # than the whole pair matrix.
        chunk = max(block, min(settings.max_block_elements, grid))
        total += working_set_bytes(sizes, settings, lanes, chunk, block)
        total += min(settings.max_block_elements, grid) * item  # blocks kept between the passes
        if "blocks" in outputs:
            # Keeping blocks fragments the heap by up to a chunk's temporaries per chunk, until
            # app/core/heap.py trims it at TRIM_SLACK_BYTES of growth.
            chunks = -(-grid // max(1, chunk))
            heap_slack = min(TRIM_SLACK_BYTES, untrimmed_growth(chunks * chunk * item))  # a bound: no margin
    if "blocks" in outputs:
        total += answer.block_per_number * block
        total += answer.block_row_per_number * side * n * 2 * dim
        total += answer.grid_per_number * grid
    head_numbers = (numbers if "accumulated" in outputs else 0) + (factor * factor if "losses" in outputs else 0)
    total += answer.head_per_number * head_numbers + answer.head_fixed
    return int(total * MARGIN) + heap_slack


def body_parse_bytes(body_bytes: int, binary: bool) -> int:
    """Bytes a body of `body_bytes` may take while it is read and parsed, before its sizes are
    known. Already the worst case, so no margin: about JSON_INPUT_BYTES_PER_NUMBER of Python
    objects per two body bytes (docs/benchmarks.md)."""
    parsed = 4 * body_bytes if binary else JSON_INPUT_BYTES_PER_NUMBER * (body_bytes // 2)
    return FIXED_BYTES + 2 * body_bytes + parsed


def upload_bytes(received: int) -> int:
    """Bytes a body still arriving holds: what has arrived, and the buffer grown to hold it."""
    return 2 * received


@dataclass(frozen=True)
class Prediction:
    bytes: int  # what the request adds to its worker at its peak
    seconds: float  # computing and writing it, by the cost model


def admit(sizes: Sizes, answer: AnswerCost, settings: Settings, lanes: int = 1) -> Prediction | None:
    """The prediction, or limit_exceeded. None when only N and D were checked: the factor or
    outputs as sent are not valid, so converting the request will refuse it. `lanes`: the
    most compute slots the request may take at once; memory is predicted for that many (the
    reservation is never resized while it runs), time for one (the conservative case)."""
    check_shape(sizes.n, sizes.dim, settings)
    if sizes.factor is None or sizes.outputs is None:
        return None
    if sizes.outputs:  # nothing computed (/v2 asking only for bounds): no block limit applies
        check_block_and_answer(sizes, settings)
        check_activations(sizes, settings)
    seconds = predict_seconds(sizes, settings) if sizes.outputs else 0.0
    if seconds > settings.request_timeout_s:
        raise over_the_deadline(sizes, seconds, settings)
    return Prediction(predict_peak_bytes(sizes, answer, settings, lanes), seconds)


def output_elements(n: int, dim: int, factor: int, outputs: tuple[str, ...]) -> int:
    sizes = {"blocks": n * n * 2 * dim, "accumulated": n * dim, "losses": factor * factor}
    return sum(sizes[name] for name in outputs)


def largest_block_side(n: int, factor: int) -> int:
    """Rows (= columns) of the largest block: the last row-block takes the remainder."""
    base = n // factor
    return max(base, n - (factor - 1) * base)


def block_elements(n: int, dim: int, factor: int) -> int:
    return largest_block_side(n, factor) ** 2 * 2 * dim


def suggested_factor(sizes: Sizes, settings: Settings) -> int | None:
    """Among the factors that fit every limit for these outputs, the one the cost model
    predicts fastest (the smaller on a tie); None when none fits. Not "the smallest larger
    factor": the last block takes the remainder, so a larger factor can be worse, and a
    factor with hundreds of thousands of blocks fits but is slow."""
    fitting = (replace(sizes, factor=f) for f in range(1, sizes.n + 1))
    best = min((s for s in fitting if block_elements(s.n, s.dim, s.factor) <= settings.max_block_elements
                and output_elements(s.n, s.dim, s.factor, s.outputs) <= settings.max_output_elements),
               key=lambda s: (predict_seconds(s, settings), s.factor), default=None)
    return None if best is None else best.factor


def advice(sizes: Sizes, settings: Settings) -> tuple[str, dict]:
    """What to send instead, and the details that go with it: a factor where one fits, else what else to change."""
    factor = suggested_factor(sizes, settings)
    if factor is not None:
        seconds = predict_seconds(replace(sizes, factor=factor), settings)
        return (f"factor {factor} fits every limit for these outputs and is predicted fastest "
                f"(about {seconds:.2g} s by the cost model)"), {"suggested_factor": factor}
    if block_elements(sizes.n, sizes.dim, sizes.n) > settings.max_block_elements:
        return "send shorter vectors: even one pair is too large", {}
    return ("no factor fits every limit with outputs " + ", ".join(sizes.outputs)
            + ": ask for fewer outputs (for example only accumulated and losses) or send fewer vectors"), {}


def check_shape(n: int, dim: int, settings: Settings) -> None:
    """N and D alone: checked as soon as they are known."""
    if n > settings.max_n:
        raise too_many_vectors(n, settings.max_n)
    if dim > settings.max_d:
        raise too_long_vectors(dim, settings.max_d)


def check_block_and_answer(sizes: Sizes, settings: Settings) -> None:
    n, dim, factor, outputs = sizes.n, sizes.dim, sizes.factor, sizes.outputs
    max_block = settings.max_block_elements
    per_block = block_elements(n, dim, factor)
    if per_block > max_block:
        text, extra = advice(sizes, settings)
        raise limit_exceeded(
            f"With factor {factor} the largest block holds {per_block} numbers, over "
            f"BLOCKGRAD_MAX_BLOCK_ELEMENTS = {max_block}; {text}.",
            "BLOCKGRAD_MAX_BLOCK_ELEMENTS", per_block, max_block, **extra)
    max_output = settings.max_output_elements
    total = output_elements(n, dim, factor, outputs)
    if total > max_output:
        # Only the losses (F x F) depend on the factor: a smaller one helps when they are what is over.
        fixed = output_elements(n, dim, factor, tuple(o for o in outputs if o != "losses"))
        if "losses" in outputs and fixed < max_output:
            text, extra = advice(sizes, settings)
        else:
            text, extra = ("ask for fewer outputs (for example only accumulated and losses) "
                           "or send fewer vectors"), {}
        raise limit_exceeded(
            f"The answer would hold {total} numbers, over BLOCKGRAD_MAX_OUTPUT_ELEMENTS = {max_output}; {text}.",
            "BLOCKGRAD_MAX_OUTPUT_ELEMENTS", total, max_output, **extra)


def activation_bytes(n: int, factor: int, bytes_per_pair: int) -> int:
    """A model's estimated peak activation memory for the largest block: its pairs x bytes_per_pair."""
    return largest_block_side(n, factor) ** 2 * bytes_per_pair


def check_activations(sizes: Sizes, settings: Settings) -> None:
    """A model objective's activations for the largest block must fit BLOCKGRAD_MAX_ACTIVATION_BYTES;
    built-ins (no bytes_per_pair) are bounded by BLOCKGRAD_MAX_BLOCK_ELEMENTS alone."""
    per_pair, n, factor = sizes.bytes_per_pair, sizes.n, sizes.factor
    if per_pair is None:
        return
    limit = settings.max_activation_bytes
    needed = activation_bytes(n, factor, per_pair)
    if needed <= limit:
        return
    fitting = next((f for f in range(factor, n + 1) if activation_bytes(n, f, per_pair) <= limit), None)
    text = (f"factor {fitting} fits (the smallest larger factor that does)" if fitting
            else "this model's activations for even one pair are too large")
    raise limit_exceeded(
        f"With factor {factor} the model's activations for the largest block take about {needed} bytes "
        f"({per_pair} bytes per pair), over BLOCKGRAD_MAX_ACTIVATION_BYTES = {limit}; {text}.",
        "BLOCKGRAD_MAX_ACTIVATION_BYTES", needed, limit)


def over_the_deadline(sizes: Sizes, predicted: float, settings: Settings):
    deadline = settings.request_timeout_s
    extra: dict = {"predicted_s": round(predicted, 3), "deadline_s": deadline}
    text = "send fewer vectors or ask for fewer outputs"
    better = suggested_factor(sizes, settings)
    if better is not None and better != sizes.factor:
        better_s = predict_seconds(replace(sizes, factor=better), settings)
        if better_s <= deadline:
            extra["suggested_factor"] = better
            text = f"factor {better} is predicted to take about {better_s:.2g} s"
    return limit_exceeded(
        f"This request is predicted to take about {predicted:.3g} s, over the deadline "
        f"BLOCKGRAD_REQUEST_TIMEOUT_S = {deadline:g} s; {text}.",
        "BLOCKGRAD_REQUEST_TIMEOUT_S", round(predicted, 3), deadline, **extra)


@dataclass
class Reservation:
    ledger: "MemoryLedger"
    nbytes: int
    released: bool = False
    uploading: bool = False  # a body still arriving: counted in the ledger's `uploading` too

    def release(self) -> None:
        """Idempotent: a stream's end and its close may both call it."""
        ledger = self.ledger
        with ledger._lock:
            if not self.released:
                self.released = True
                ledger.reserved -= self.nbytes
                if self.uploading:
                    ledger.uploading -= self.nbytes

    def resize(self, nbytes: int) -> None:
        """Hold `nbytes` instead (e.g. the prediction once the sizes are known); raises as reserve."""
        self.ledger._resize(self, nbytes)

    def settle(self) -> None:
        """The body has arrived: from now on the reservation counts against the budget only."""
        with self.ledger._lock:
            if self.uploading and not self.released:
                self.ledger.uploading -= self.nbytes
            self.uploading = False


class MemoryLedger:
    """One worker's reserved bytes, shared by its threads (gthread) or held by one request (sync)."""

    def __init__(self, budget: int, upload_share: float = 1.0):
        self.budget = budget
        self.upload_budget = int(budget * min(1.0, upload_share))  # what uploads may hold together
        self.reserved = 0
        self.uploading = 0  # the part of `reserved` held by bodies still arriving
        self._lock = threading.Lock()

    def check_budget(self, nbytes: int) -> None:
        """limit_exceeded if `nbytes` could never fit, whatever else is reserved; reserves nothing."""
        if nbytes > self.budget:
            raise memory_limit_exceeded(nbytes, self.budget)

    def reserve(self, nbytes: int, uploading: bool = False) -> Reservation:
        """`nbytes` reserved until released; limit_exceeded (over the budget alone) or
        memory_busy (only the current load is in the way). `uploading`: for a body still
        arriving, within the uploads' share too (uploads_busy when other uploads fill it)."""
        reservation = Reservation(self, 0, uploading=uploading)
        self._resize(reservation, nbytes)
        return reservation

    def _resize(self, reservation: Reservation, nbytes: int) -> None:
        self.check_budget(nbytes)
        with self._lock:
            if reservation.released:
                return
            others = self.reserved - reservation.nbytes
            if others + nbytes > self.budget:
                raise memory_busy(nbytes, others, self.budget)
            if reservation.uploading:
                if nbytes > self.upload_budget:
                    raise upload_limit_exceeded(nbytes, self.upload_budget)
                other_uploads = self.uploading - reservation.nbytes
                if other_uploads + nbytes > self.upload_budget:
                    raise uploads_busy(nbytes, other_uploads, self.upload_budget)
                self.uploading = other_uploads + nbytes
            self.reserved, reservation.nbytes = others + nbytes, nbytes
