"""The engine's cost model: predicted seconds of a request from its sizes alone.

time = stages x (blocks x cost per block + numbers x cost per number)
     + (answer with blocks) x (blocks x output per block + numbers x output per number)

with blocks = F x F and numbers = N x N x 2D (every block's entries). Pass one is one
stage; asking for the blocks adds pass two when their gradients cannot be kept from
pass one (dense gradients over the keep budget, app/core/run.py), and the output terms
(taking each block apart and writing it as JSON, /v1's slower encoding).

The constants were measured with `python -m bench.costs` (least squares over requests
that vary the block count and the number count; one torch thread, the 2-core machine of
docs/benchmarks.md; noisy, within about 2x). BLOCKGRAD_COST_PER_BLOCK_S and
BLOCKGRAD_COST_PER_NUMBER_S, when set, replace every constant (compute and output) so
that a test's verdict never depends on the machine.

Used for the 413's suggested factor (app/core/limits.py) and for compute admission.
"""
from .settings import Settings

# (objective, dtype) -> (seconds per block, seconds per number) of pass one.
COMPUTE_COSTS: dict[tuple[str, str], tuple[float, float]] = {
    ("sum", "float32"): (3.56e-08, 2.34e-09),
    ("sum", "float64"): (1.51e-07, 6.45e-09),
    ("mean", "float32"): (8.90e-08, 2.35e-09),
    ("mean", "float64"): (8.86e-08, 5.40e-09),
    ("sum_of_squares", "float32"): (4.93e-08, 3.94e-09),
    ("sum_of_squares", "float64"): (1.31e-08, 9.71e-09),
    ("l2_norm", "float32"): (5.50e-08, 4.79e-09),
    ("l2_norm", "float64"): (9.89e-08, 6.89e-09),
    ("logsumexp", "float32"): (7.16e-08, 3.92e-09),
    ("logsumexp", "float64"): (9.86e-08, 8.21e-09),
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


def predict_seconds(n: int, dim: int, factor: int, objective_name: str, dtype: str,
                    outputs: tuple[str, ...], settings: Settings) -> float:
    """Predicted seconds of computing (and, for blocks, writing) the answer on this machine's CPU."""
    blocks, numbers = factor * factor, n * n * 2 * dim
    per_block, per_number = compute_costs(objective_name, dtype, settings)
    stages = 1
    seconds = 0.0
    if "blocks" in outputs:
        stages += recomputes_blocks(n, dim, objective_name, settings)
        out_block, out_number = output_costs(dtype, settings)
        seconds += blocks * out_block + numbers * out_number
    return seconds + stages * (blocks * per_block + numbers * per_number)
