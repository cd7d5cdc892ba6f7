"""Admission: from a request's sizes alone, before any number is converted, its predicted
peak bytes and seconds, or a refusal (limit_exceeded) that names the limit and what to change.

`admit` is the one call. It checks, in order: N and D; the largest block; the whole answer;
a model objective's activations; the predicted seconds against the deadline (the cost
model, app/core/cost.py, at one compute slot); and predicts the peak bytes
(app/core/memory.py, at the most slots the request may take), which the caller reserves
in the worker's ledger. A refusal that a factor would cure carries
details.suggested_factor. The deadline is still checked between blocks: the cost model is
an estimate.
"""
from dataclasses import dataclass, replace

from .cost import predict_seconds
from .engine import largest_block_side
from .errors import limit_exceeded
from .memory import AnswerCost, predict_peak_bytes
from .settings import Settings
from .sizes import Sizes

__all__ = ["Sizes", "Prediction", "admit", "check_shape", "suggested_factor", "output_elements"]


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


def block_elements(n: int, dim: int, factor: int) -> int:
    side = largest_block_side(n, factor)
    return side * side * 2 * dim


def fits_every_limit(sizes: Sizes, settings: Settings) -> bool:
    return (block_elements(sizes.n, sizes.dim, sizes.factor) <= settings.max_block_elements
            and output_elements(sizes.n, sizes.dim, sizes.factor, sizes.outputs) <= settings.max_output_elements)


def suggested_factor(sizes: Sizes, settings: Settings) -> int | None:
    """Among the factors that fit every limit for these outputs, the one the cost model
    predicts fastest (the smaller on a tie); None when none fits. Not "the smallest larger
    factor": the last block takes the remainder, so a larger factor can be worse, and a
    factor with hundreds of thousands of blocks fits but is slow."""
    fitting = (replace(sizes, factor=f) for f in range(1, sizes.n + 1))
    best = min((s for s in fitting if fits_every_limit(s, settings)),
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
    max_n, max_d = settings.max_n, settings.max_d
    if n > max_n:
        raise limit_exceeded(f"{n} vectors is over BLOCKGRAD_MAX_N = {max_n}; send at most {max_n}.",
                             "BLOCKGRAD_MAX_N", n, max_n)
    if dim > max_d:
        raise limit_exceeded(f"Vectors of length {dim} are over BLOCKGRAD_MAX_D = {max_d}; send at most {max_d}.",
                             "BLOCKGRAD_MAX_D", dim, max_d)


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
    side = largest_block_side(n, factor)
    return side * side * bytes_per_pair


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
