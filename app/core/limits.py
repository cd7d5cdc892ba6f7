"""Admission control: refuse, from the sizes alone, what this worker cannot serve.

Runs before any tensor is allocated, so a refusal costs milliseconds at any size.
"""
from .cost import predict_seconds
from .engine import largest_block_side
from .errors import limit_exceeded
from .objectives import DEFAULT_OBJECTIVE
from .request import DEFAULT_DTYPE, GradientRequest
from .settings import Settings


def output_elements(n: int, dim: int, factor: int, outputs: tuple[str, ...]) -> int:
    sizes = {"blocks": n * n * 2 * dim, "accumulated": n * dim, "losses": factor * factor}
    return sum(sizes[name] for name in outputs)


def block_elements(n: int, dim: int, factor: int) -> int:
    side = largest_block_side(n, factor)
    return side * side * 2 * dim


def fits_every_limit(n: int, dim: int, factor: int, outputs: tuple[str, ...], settings: Settings) -> bool:
    return (block_elements(n, dim, factor) <= settings.max_block_elements
            and output_elements(n, dim, factor, outputs) <= settings.max_output_elements)


def suggested_factor(n: int, dim: int, outputs: tuple[str, ...], settings: Settings,
                     objective: str = DEFAULT_OBJECTIVE, dtype: str = DEFAULT_DTYPE) -> int | None:
    """Among the factors that fit every limit for these outputs, the one the cost model
    predicts fastest (the smaller on a tie); None when none fits. Not "the smallest larger
    factor": the last block takes the remainder, so a larger factor can be worse, and a
    factor with hundreds of thousands of blocks fits but is slow."""
    fitting = (f for f in range(1, n + 1) if fits_every_limit(n, dim, f, outputs, settings))
    return min(fitting, key=lambda f: (predict_seconds(n, dim, f, objective, dtype, outputs, settings), f),
               default=None)


def advice(n: int, dim: int, outputs: tuple[str, ...], settings: Settings, objective: str, dtype: str,
           ) -> tuple[str, dict]:
    """What to send instead, and the details that go with it: a factor where one fits, else what else to change."""
    factor = suggested_factor(n, dim, outputs, settings, objective, dtype)
    if factor is not None:
        seconds = predict_seconds(n, dim, factor, objective, dtype, outputs, settings)
        return (f"factor {factor} fits every limit for these outputs and is predicted fastest "
                f"(about {seconds:.2g} s by the cost model)"), {"suggested_factor": factor}
    if block_elements(n, dim, n) > settings.max_block_elements:
        return "send shorter vectors: even one pair is too large", {}
    return ("no factor fits every limit with outputs " + ", ".join(outputs)
            + ": ask for fewer outputs (for example only accumulated and losses) or send fewer vectors"), {}


def admit_shape(n: int, dim: int, settings: Settings) -> None:
    """N and D alone: checked as soon as they are known, before the numbers are converted."""
    max_n, max_d = settings.max_n, settings.max_d
    if n > max_n:
        raise limit_exceeded(f"{n} vectors is over BLOCKGRAD_MAX_N = {max_n}; send at most {max_n}.",
                             "BLOCKGRAD_MAX_N", n, max_n)
    if dim > max_d:
        raise limit_exceeded(f"Vectors of length {dim} are over BLOCKGRAD_MAX_D = {max_d}; send at most {max_d}.",
                             "BLOCKGRAD_MAX_D", dim, max_d)


def admit(n: int, dim: int, factor: int, outputs: tuple[str, ...], settings: Settings,
          objective: str = DEFAULT_OBJECTIVE, dtype: str = DEFAULT_DTYPE) -> None:
    """Raise limit_exceeded naming the limit and what to change, or return.

    The one admission function: each front end calls it as soon as it knows the
    sizes (before converting numbers), and `run` calls it again on the request.
    A refusal that a factor would cure carries details.suggested_factor."""
    admit_shape(n, dim, settings)
    max_block = settings.max_block_elements
    per_block = block_elements(n, dim, factor)
    if per_block > max_block:
        text, extra = advice(n, dim, outputs, settings, objective, dtype)
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
            text, extra = advice(n, dim, outputs, settings, objective, dtype)
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


def admit_activations(n: int, factor: int, objective, settings: Settings) -> None:
    """A model objective's activations for the largest block must fit BLOCKGRAD_MAX_ACTIVATION_BYTES;
    built-ins (no bytes_per_pair) are bounded by BLOCKGRAD_MAX_BLOCK_ELEMENTS alone."""
    per_pair = getattr(objective, "bytes_per_pair", None)
    if per_pair is None:
        return
    limit = settings.max_activation_bytes
    needed = activation_bytes(n, factor, per_pair)
    if needed <= limit:
        return
    fitting = next((f for f in range(factor, n + 1) if activation_bytes(n, f, per_pair) <= limit), None)
    advice = (f"factor {fitting} fits (the smallest larger factor that does)" if fitting
              else "this model's activations for even one pair are too large")
    raise limit_exceeded(
        f"With factor {factor} the model's activations for the largest block take about {needed} bytes "
        f"({per_pair} bytes per pair), over BLOCKGRAD_MAX_ACTIVATION_BYTES = {limit}; {advice}.",
        "BLOCKGRAD_MAX_ACTIVATION_BYTES", needed, limit)


def admit_request(req: GradientRequest, settings: Settings) -> None:
    """Every size limit a built request must fit: the front ends call it before the request
    queues for the compute slot (a refusal never waits), and `run` again."""
    admit(req.n, req.dim, req.factor, req.outputs, settings, req.objective, req.dtype)
    admit_activations(req.n, req.factor, req.objective_fn, settings)
