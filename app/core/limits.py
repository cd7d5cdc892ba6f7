"""Admission control: refuse, from the sizes alone, what this worker cannot serve.

Runs before any tensor is allocated, so a refusal costs milliseconds at any size.
"""
from .engine import largest_block_side
from .errors import limit_exceeded
from .settings import Settings


def output_elements(n: int, dim: int, factor: int, outputs: tuple[str, ...]) -> int:
    sizes = {"blocks": n * n * 2 * dim, "accumulated": n * dim, "losses": factor * factor}
    return sum(sizes[name] for name in outputs)


def block_elements(n: int, dim: int, factor: int) -> int:
    side = largest_block_side(n, factor)
    return side * side * 2 * dim


def smallest_fitting_factor(n: int, dim: int, factor: int, limit: int) -> int | None:
    return next((f for f in range(factor, n + 1) if block_elements(n, dim, f) <= limit), None)


def admit_shape(n: int, dim: int, settings: Settings) -> None:
    """N and D alone: checked as soon as they are known, before the numbers are converted."""
    max_n, max_d = settings.max_n, settings.max_d
    if n > max_n:
        raise limit_exceeded(f"{n} vectors is over BLOCKGRAD_MAX_N = {max_n}; send at most {max_n}.",
                             "BLOCKGRAD_MAX_N", n, max_n)
    if dim > max_d:
        raise limit_exceeded(f"Vectors of length {dim} are over BLOCKGRAD_MAX_D = {max_d}; send at most {max_d}.",
                             "BLOCKGRAD_MAX_D", dim, max_d)


def admit(n: int, dim: int, factor: int, outputs: tuple[str, ...], settings: Settings) -> None:
    """Raise limit_exceeded naming the limit and what to change, or return.

    The one admission function: each front end calls it as soon as it knows the
    sizes (before converting numbers), and `run` calls it again on the request."""
    admit_shape(n, dim, settings)
    max_block = settings.max_block_elements
    per_block = block_elements(n, dim, factor)
    if per_block > max_block:
        fitting = smallest_fitting_factor(n, dim, factor, max_block)
        # Not "at least": the last block takes the remainder, so a larger factor can be worse.
        advice = (f"factor {fitting} fits (the smallest larger factor that does)" if fitting
                  else "send shorter vectors: even one pair is too large")
        raise limit_exceeded(
            f"With factor {factor} the largest block holds {per_block} numbers, over "
            f"BLOCKGRAD_MAX_BLOCK_ELEMENTS = {max_block}; {advice}.",
            "BLOCKGRAD_MAX_BLOCK_ELEMENTS", per_block, max_block)
    max_output = settings.max_output_elements
    total = output_elements(n, dim, factor, outputs)
    if total > max_output:
        raise limit_exceeded(
            f"The answer would hold {total} numbers, over BLOCKGRAD_MAX_OUTPUT_ELEMENTS = {max_output}; "
            "ask for fewer outputs (for example only accumulated and losses) or send fewer vectors.",
            "BLOCKGRAD_MAX_OUTPUT_ELEMENTS", total, max_output)



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
