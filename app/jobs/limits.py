"""A job's own limits, from its sizes alone (the synchronous N, block, answer and deadline
limits do not apply to jobs)."""
import math

from ..core.admission import block_elements, output_elements
from ..core.dtypes import DTYPES
from ..core.errors import limit_exceeded, result_too_large, too_long_vectors, too_many_vectors
from ..core.request import Sizes
from .settings import JobSettings


def fitting_factor(n: int, dim: int, allowed: int) -> int | None:
    """The smallest factor whose largest block fits `allowed` numbers (fewest blocks: fastest)."""
    if 2 * dim > allowed:
        return None
    start = max(1, math.floor(n / math.sqrt(allowed / (2 * dim))))
    return next((f for f in range(start, n + 1) if block_elements(n, dim, f) <= allowed), None)


def admit_job(sizes: Sizes, max_d: int, settings: JobSettings) -> None:
    """`sizes.factor` None: not valid as sent (the request's own validation names it). `max_d`:
    the core's BLOCKGRAD_MAX_D, which jobs share."""
    n, dim, factor = sizes.n, sizes.dim, sizes.factor
    if n > settings.max_job_n:
        raise too_many_vectors(n, settings.max_job_n, "BLOCKGRAD_MAX_JOB_N")
    if dim > max_d:
        raise too_long_vectors(dim, max_d)
    if factor is None:
        return
    if sizes.outputs is not None:  # None: not valid as sent, named by the validation
        # The outputs asked for (losses F x F, accumulated N x D) fit one job's result and the
        # results kept: what the runner holds on its way into the store and what the store keeps.
        nbytes = output_elements(n, dim, factor, sizes.outputs) * DTYPES[sizes.dtype].item_bytes
        allowed, limit = min((settings.max_job_result_bytes, "BLOCKGRAD_MAX_JOB_RESULT_BYTES"),
                             (settings.max_job_results_bytes, "BLOCKGRAD_MAX_JOB_RESULTS_BYTES"), key=lambda p: p[0])
        if nbytes > allowed:
            raise result_too_large(nbytes, allowed, limit)
    allowed = settings.max_job_block_elements
    per_block = block_elements(n, dim, factor)
    if per_block <= allowed:
        return
    suggested = fitting_factor(n, dim, allowed)
    advice, extra = ((f"factor {suggested} fits (the smallest that does)", {"suggested_factor": suggested}) if suggested
                     else ("send shorter vectors: even one pair is too large", {}))
    raise limit_exceeded(f"With factor {factor} a job's largest block holds {per_block} numbers, over "
                         f"BLOCKGRAD_MAX_JOB_BLOCK_ELEMENTS = {allowed}; {advice}.",
                         "BLOCKGRAD_MAX_JOB_BLOCK_ELEMENTS", per_block, allowed, **extra)
