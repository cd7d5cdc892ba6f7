"""Measure the cost model's constants (app/core/admission.py): seconds per block and per number
of pass one, per objective and dtype, fitted by least squares over a few requests that
vary the block count at a fixed number count and the number count at a fixed block count,
weighted by relative error.

`python -m bench.costs` prints the table in the form app/core/admission.py holds it.
"""
import sys
import time

import numpy as np
import torch

from app.core.admission import engine_work
from app.core.objectives import OBJECTIVES
from app.core.request import GradientRequest
from app.core.run import Deadline, run
from app.core.settings import Settings

# (N, D, F): blocks from 36 to ~1M, entries from 4M to 537M, D from 2 to 64, 40 ms to 1 s.
CASES = ((1000, 64, 6), (1000, 64, 64), (1000, 64, 333), (512, 64, 86), (512, 64, 171), (1024, 2, 1024),
         (2048, 16, 400), (4096, 8, 1024))


def pass_one_seconds(n: int, dim: int, factor: int, objective: str, dtype: str, repeats: int = 2) -> float:
    req = GradientRequest(vectors=np.random.default_rng(0).standard_normal((n, dim)), factor=factor,
                          objective=objective, offset=5.0, outputs=("accumulated",), dtype=dtype)
    settings = Settings(device="cpu")
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        start = time.perf_counter()
        run(req, settings, Deadline(3600))
        times.append(time.perf_counter() - start)
    return min(times[1:])


def fit(objective: str, dtype: str) -> tuple[float, float, float]:
    """(seconds per block, seconds per number, worst relative error over the cases): least
    squares on relative errors, so a 30 ms request weighs as much as a 3 s one."""
    rows, seconds = [], []
    for n, dim, factor in CASES:
        rows.append(engine_work(n, dim, factor))
        seconds.append(pass_one_seconds(n, dim, factor, objective, dtype))
    work, measured = np.array(rows, dtype=float), np.array(seconds)
    (per_block, per_number), *_ = np.linalg.lstsq(work / measured[:, None], np.ones(len(measured)), rcond=None)
    per_block, per_number = max(per_block, 0.0), max(per_number, 0.0)
    worst = float(np.max(np.abs(work @ np.array([per_block, per_number]) / measured - 1)))
    return per_block, per_number, worst


def main() -> int:
    torch.set_num_threads(1)  # one gunicorn worker's threads on the 2-core machine
    for objective in OBJECTIVES:
        for dtype in ("float32", "float64"):
            per_block, per_number, worst = fit(objective, dtype)
            print(f'    ("{objective}", "{dtype}"): ({per_block:.2e}, {per_number:.2e}),  # worst case off by '
                  f'{worst:.0%}', flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
