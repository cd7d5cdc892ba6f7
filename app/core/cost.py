"""The engine's cost model: predicted seconds of a request from its sizes alone.

time = stages x (blocks x cost per block + numbers x cost per number)
     + (answer with blocks) x (blocks x output per block + entries x output per number)

with blocks = F x F, entries = N x N x 2D (every block's entries) and numbers = entries +
F x N x 2D: the engine also writes each block's row and column sums for the chain rule,
(h + w) x D numbers a block, which is what makes many small blocks dearer than a few
large ones; and the entries of blocks larger than a chunk (1M numbers) count twice, as
they run out of cache (`engine_work`). Pass one is one stage; asking for the blocks adds pass two when their
gradients cannot be kept from pass one (dense gradients over the keep budget,
app/core/run.py), and the output terms (taking each block apart and writing it as JSON,
/v1's slower encoding).

The constants come from `python -m bench.costs` (least squares on relative error; how and
how far off they are: docs/benchmarks.md). They are one machine's CPU; a faster CPU (or a
GPU) is overpredicted. BLOCKGRAD_COST_PER_BLOCK_S
and BLOCKGRAD_COST_PER_NUMBER_S, when set, replace every constant (compute and output) so
that a test's verdict never depends on the machine.

Used by admission (app/core/admission.py): the deadline check and the 413's suggested factor.
"""
from .engine import DEFAULT_CHUNK_ELEMENTS, shape_groups
from .settings import Settings
from .sizes import Sizes

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


def compute_costs(objective_name: str, dtype: str, settings: Settings) -> tuple[float, float]:
    per_block, per_number = COMPUTE_COSTS.get((objective_name, dtype), UNKNOWN_OBJECTIVE)
    return (per_block if settings.cost_per_block_s is None else settings.cost_per_block_s,
            per_number if settings.cost_per_number_s is None else settings.cost_per_number_s)


def output_costs(dtype: str, settings: Settings) -> tuple[float, float]:
    per_block, per_number = OUTPUT_COSTS[dtype] if dtype in OUTPUT_COSTS else OUTPUT_COSTS["float64"]
    return (per_block if settings.cost_per_block_s is None else settings.cost_per_block_s,
            per_number if settings.cost_per_number_s is None else settings.cost_per_number_s)


def recomputes_blocks(n: int, dim: int, objective_name: str, settings: Settings) -> bool:
    """Whether pass two recomputes the blocks: dense gradients past the keep budget."""
    return objective_name not in SCALAR_GRADIENTS and n * n * 2 * dim > settings.max_block_elements


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
    per_block, per_number = compute_costs(objective, dtype, settings)
    stages = 1
    seconds = 0.0
    if "blocks" in sizes.outputs:
        stages += recomputes_blocks(n, dim, objective, settings)
        out_block, out_number = output_costs(dtype, settings)
        seconds += blocks * out_block + n * n * 2 * dim * out_number
    return seconds + stages * (blocks * per_block + numbers * per_number)
