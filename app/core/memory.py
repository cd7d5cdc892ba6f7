"""A request's predicted peak memory, and the worker's budget for it.

`predict_peak_bytes` adds up what a request holds at its peak, from its sizes and the
front end's `AnswerCost` alone: its body and the parsed input, the engine's working set
(a chunk of at most BLOCKGRAD_MAX_BLOCK_ELEMENTS numbers and what the objective derives
from it, blocks kept between the passes; on k compute slots, k chunks in flight and the
chunks computed ahead: `working_set_bytes`), and the
answer as the front end writes it (whole arrays, text a block or a slice at a time).
A request is predicted for the most slots it may take (its reservation is never resized
while it runs). Admission (admission.py) calls it. The coefficients are measured, not guessed: `python -m
bench.memory` runs each case on a fresh gunicorn worker and prints the measured peak
beside this prediction (docs/benchmarks.md, "Peak worker memory per case"); each
coefficient is the largest measured per-unit cost, rounded up.

`MemoryLedger` is the worker's account: the bytes reserved by the requests it holds
(computing, queued, bodies being parsed). A request is admitted when its prediction
plus what is reserved fits BLOCKGRAD_WORKER_MEMORY_BYTES; a prediction over the budget
alone is `limit_exceeded` (413), one that only the current load keeps out is
`memory_busy` (503, Retry-After).

A body is reserved for as it arrives, never for what its Content-Length declares:
`upload_bytes` of what has arrived while it is still arriving, `body_parse_bytes` once it is
complete. Bodies still arriving (uploads) together hold at most BLOCKGRAD_UPLOAD_MEMORY_SHARE
of the budget, so that clients sending slowly can hold back other uploads, never a request
whose body has arrived.
"""
import itertools
import threading
from dataclasses import dataclass
from types import SimpleNamespace

from .dtypes import DTYPES, WIDEST
from .engine import PARALLEL_CHUNK_ELEMENTS, elements_per_chunk, largest_block_side, plan_bands
from .errors import BlockgradError, limit_exceeded
from .executor import LOOKAHEAD_PER_LANE
from .heap import TRIM_SLACK_BYTES, untrimmed_growth
from .settings import Settings
from .sizes import Sizes

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


def chunk_numbers(n: int, dim: int, factor: int, settings: Settings) -> int:
    """Numbers in a chunk as predicted: at most max_block_elements, at least one block,
    never more than the whole pair matrix."""
    side = largest_block_side(n, factor)
    return max(side * side * 2 * dim, min(settings.max_block_elements, n * n * 2 * dim))


def working_set_bytes(sizes: Sizes, settings: Settings, lanes: int = 1) -> int:
    """The engine's working set in pass one: serially a chunk's (CHUNKS_IN_FLIGHT of its
    size); on up to `lanes` slots the larger of that and, for each lane, a parallel chunk's
    working set and LOOKAHEAD_PER_LANE chunks' results waiting (app/core/executor.py).
    The larger, because a request on several lanes may still find
    no second slot free, and off the CPU runs serially with whole chunks."""
    n, dim, factor = sizes.n, sizes.dim, sizes.factor
    item = DTYPES.get(sizes.dtype, WIDEST).item_bytes
    per_chunk = CHUNKS_IN_FLIGHT.get(sizes.objective, DEFAULT_CHUNKS_IN_FLIGHT)
    chunk = chunk_numbers(n, dim, factor, settings)
    serial = per_chunk * chunk * item
    lanes = request_lanes(sizes, settings, lanes)
    if lanes <= 1:  # one slot, or one chunk: inline, as serially
        return serial
    side = largest_block_side(n, factor)
    small = max(side * side * 2 * dim, min(PARALLEL_CHUNK_ELEMENTS, chunk))  # a block is never split
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
    if outputs:
        chunk = chunk_numbers(n, dim, factor, settings)
        chunk_bytes = chunk * item
        total += working_set_bytes(sizes, settings, lanes)
        total += min(settings.max_block_elements, grid) * item  # blocks kept between the passes
        if "blocks" in outputs:
            # Keeping blocks fragments the heap by up to a chunk's temporaries per chunk, until
            # app/core/heap.py trims it at TRIM_SLACK_BYTES of growth.
            chunks = -(-grid // max(1, chunk))
            heap_slack = min(TRIM_SLACK_BYTES, untrimmed_growth(chunks * chunk_bytes))  # a bound: no margin
    if "blocks" in outputs:
        side = largest_block_side(n, factor)
        total += answer.block_per_number * side * side * 2 * dim
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


def memory_limit_exceeded(predicted: int, budget: int) -> BlockgradError:
    return limit_exceeded(
        f"This request would take about {predicted // 2 ** 20} MiB at its peak, over "
        f"BLOCKGRAD_WORKER_MEMORY_BYTES = {budget // 2 ** 20} MiB per worker; send a larger factor, "
        "fewer outputs (binary /v2 outputs are the smallest), float32 or fewer vectors.",
        "BLOCKGRAD_WORKER_MEMORY_BYTES", predicted, budget)


MEMORY_BUSY_RETRY_AFTER_S = 2


def memory_busy(predicted: int, reserved: int, budget: int) -> BlockgradError:
    return BlockgradError(
        "overloaded",
        f"This worker's memory is taken by the requests it holds ({reserved // 2 ** 20} MiB of "
        f"{budget // 2 ** 20} MiB); this one needs about {predicted // 2 ** 20} MiB: retry after the "
        "Retry-After seconds, on any replica.",
        {"limit": "BLOCKGRAD_WORKER_MEMORY_BYTES", "value": predicted, "reserved": reserved, "allowed": budget},
        retry_after_s=MEMORY_BUSY_RETRY_AFTER_S)


def uploads_busy(nbytes: int, uploading: int, allowed: int) -> BlockgradError:
    return BlockgradError(
        "overloaded",
        f"This worker's bodies still arriving hold {uploading // 2 ** 20} MiB of the {allowed // 2 ** 20} MiB "
        "they may share (BLOCKGRAD_UPLOAD_MEMORY_SHARE of BLOCKGRAD_WORKER_MEMORY_BYTES); send the body faster, "
        "or retry after the Retry-After seconds, on any replica.",
        {"limit": "BLOCKGRAD_UPLOAD_MEMORY_SHARE", "value": nbytes, "reserved": uploading, "allowed": allowed},
        retry_after_s=MEMORY_BUSY_RETRY_AFTER_S)


def upload_limit_exceeded(nbytes: int, allowed: int) -> BlockgradError:
    return limit_exceeded(
        f"This body takes about {nbytes // 2 ** 20} MiB while it arrives, over the {allowed // 2 ** 20} MiB "
        "that bodies still arriving may hold (BLOCKGRAD_UPLOAD_MEMORY_SHARE of BLOCKGRAD_WORKER_MEMORY_BYTES); "
        "send a smaller body.", "BLOCKGRAD_UPLOAD_MEMORY_SHARE", nbytes, allowed)


@dataclass
class Reservation:
    ledger: "MemoryLedger"
    nbytes: int
    released: bool = False
    uploading: bool = False  # a body still arriving: counted in the ledger's `uploading` too

    def release(self) -> None:
        """Idempotent: a stream's end and its close may both call it."""
        self.ledger._release(self)

    def resize(self, nbytes: int) -> None:
        """Hold `nbytes` instead (e.g. the prediction once the sizes are known); raises as reserve."""
        self.ledger._resize(self, nbytes)

    def settle(self) -> None:
        """The body has arrived: from now on the reservation counts against the budget only."""
        self.ledger._settle(self)


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

    def reserve_upload(self, nbytes: int) -> Reservation:
        """`nbytes` for a body still arriving: within the budget and the uploads' share
        (uploads_busy when other uploads fill it)."""
        reservation = Reservation(self, 0, uploading=True)
        self._resize(reservation, nbytes)
        return reservation

    def reserve(self, nbytes: int) -> Reservation:
        """`nbytes` reserved until released; limit_exceeded (over the budget alone) or
        memory_busy (only the current load is in the way)."""
        if nbytes > self.budget:
            raise memory_limit_exceeded(nbytes, self.budget)
        with self._lock:
            if self.reserved + nbytes > self.budget:
                raise memory_busy(nbytes, self.reserved, self.budget)
            self.reserved += nbytes
        return Reservation(self, nbytes)

    def _resize(self, reservation: Reservation, nbytes: int) -> None:
        if nbytes > self.budget:
            raise memory_limit_exceeded(nbytes, self.budget)
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

    def _settle(self, reservation: Reservation) -> None:
        with self._lock:
            if reservation.uploading and not reservation.released:
                self.uploading -= reservation.nbytes
            reservation.uploading = False

    def _release(self, reservation: Reservation) -> None:
        with self._lock:
            if not reservation.released:
                reservation.released = True
                self.reserved -= reservation.nbytes
                if reservation.uploading:
                    self.uploading -= reservation.nbytes
