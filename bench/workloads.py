"""The request bodies the benchmark sends: random vectors with a fixed seed."""
import numpy as np
import orjson

# The README's curl example: the seed question's 10 x 5 case.
SEED_EXAMPLE = [[round(0.1 * i + 0.01 * j, 2) for j in range(5)] for i in range(10)]


def vectors(n: int, dim: int, seed: int = 0) -> np.ndarray:
    """(N, D) float64, full-precision values (17 significant digits in JSON)."""
    return np.random.default_rng(seed).standard_normal((n, dim))


def body(matrix: np.ndarray | list, **fields) -> bytes:
    """A /v1/gradients JSON body; default objective (sum) and dtype (float32) unless given."""
    rows = matrix.tolist() if isinstance(matrix, np.ndarray) else matrix
    return orjson.dumps({"vectors": rows, **fields})
