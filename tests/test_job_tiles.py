"""A job's tiles and band sums computed in this process, without a cluster, composed as
app/jobs/graph.py composes them: the same numbers as /v1 and the reference, the tile
computation the local executor's own, and no task holding more than its band."""
import numpy as np
import pytest
import torch

from app import create_app
from app.core import run as executor
from app.core.engine import elements_per_chunk, plan_bands
from app.core.job_tasks import (COLS, ROWS, JobSpec, add_band, band_groups, finish, plan_tiles, reduction_levels,
                                run_tile)
from app.core.objectives import OBJECTIVES
from tests.numeric import assert_matches
from tools.reference import reference_accumulated


pytestmark = pytest.mark.usefixtures("one_thread")


def run_job(vectors: np.ndarray, spec: JobSpec, workers: int, tile_numbers: int, fan_in: int = 3,
            bands: bool = True):
    """The graph's composition in order: tiles, a tree of band sums per tile row and tile column
    (or none: a small job), finish."""
    objective = OBJECTIVES[spec.objective]
    tiles = plan_tiles(spec.n, spec.dim, spec.factor, workers, tile_numbers, least_numbers=1)
    parts = [run_tile(vectors, spec, tile, objective) for tile in tiles]
    if not bands:
        return tiles, finish(spec, *parts), 0
    bands, largest = [], 0
    for kind, groups in band_groups(tiles).items():
        for members in groups:
            level = [parts[k] for k in members]
            for sums in reduction_levels(len(level), fan_in):
                level = [add_band(kind, *(level[i] for i in group)) for group in sums]
                largest = max(largest, *(band.sums.shape[0] for band in level))
            bands.append(level[0])
    return tiles, finish(spec, *bands), largest


def spec_for(n, dim, factor, objective, dtype, offset=5.0):
    chunk = elements_per_chunk(16 * 1024 * 1024, OBJECTIVES[objective], dim, np.dtype(dtype).itemsize)
    return JobSpec(n, dim, factor, objective, offset, dtype, chunk)


@pytest.mark.parametrize("n, dim, factor, objective, dtype, bands", [
    (40, 3, 6, "sum", "float32", True),  # a larger last block row and column
    (37, 2, 7, "logsumexp", "float64", True),
    (64, 4, 8, "sum_of_squares", "float32", True),
    (37, 2, 7, "mean", "float64", False),  # finished from the tiles
])
def test_tiles_and_bands_equal_v1(n, dim, factor, objective, dtype, bands):
    vectors = np.random.default_rng(n).standard_normal((n, dim)).round(3).astype(dtype)
    spec = spec_for(n, dim, factor, objective, dtype)
    tiles, outcome, largest = run_job(vectors, spec, 2, 1, bands=bands)  # one block per tile at most
    assert len(tiles) > 4 and outcome.error is None
    sync = create_app({"TESTING": True}).test_client().post("/v1/gradients", json={
        "vectors": vectors.tolist(), "factor": factor, "objective": objective, "dtype": dtype,
        "outputs": ["accumulated", "losses"]}).get_json()
    assert np.array_equal(outcome.losses, np.array(sync["losses"], dtype=dtype))  # bit for bit (JSON round-trips)
    assert_matches(outcome.accumulated, np.array(sync["accumulated"]), dtype, what="accumulated vs /v1")
    v = torch.tensor(vectors)
    assert_matches(outcome.accumulated, reference_accumulated(v, factor, objective), dtype, what="vs reference")
    assert largest < n  # no band sum is N rows: only the finish makes the dense (N, D)


def test_bytes_moved_grow_with_the_tree_not_with_n_by_d_per_sum():
    """One-block tiles, fan-in 4: every share travels once per tree level (16 tiles per band:
    three levels), each share one block's rows x D; a dense reduction would move N x D per sum
    (85 sums here, 85 x N x D)."""
    n, dim, factor = 256, 4, 16
    vectors = np.random.default_rng(1).standard_normal((n, dim)).astype(np.float32)
    spec = spec_for(n, dim, factor, "sum", "float32")
    tiles, outcome, _ = run_job(vectors, spec, workers=2, tile_numbers=1, fan_in=4)
    share = (n // factor) * dim * 4  # one block's rows x D in float32
    bands = 2 * factor  # a row band per tile row, a column band per tile column
    assert len(tiles) == factor ** 2
    assert outcome.bytes_moved == bands * (16 + 4 + 1) * share + factor ** 2 * 4 * 3  # losses: once per level


def test_a_non_finite_block_fails_with_the_first_block():
    vectors = np.zeros((8, 1), dtype=np.float32)
    vectors[5] = 1e20  # block row and column 2 (factor 4: side 2) overflow under sum_of_squares
    spec = spec_for(8, 1, 4, "sum_of_squares", "float32")
    _, outcome, _ = run_job(vectors, spec, workers=1, tile_numbers=1)
    assert outcome.error["code"] == "non_finite_result" and outcome.error["details"]["block"] == {"row": 0, "col": 2}


def test_a_tile_is_computed_by_the_executors_tile_function(monkeypatch):
    """The local executor's lanes and a job's tasks run one pass (executor.PassOne): each
    computes every chunk of the one plan once."""
    real = executor.chunk_gradients
    spec = spec_for(12, 2, 3, "sum", "float32")
    tile = plan_tiles(12, 2, 3, 1)[0]
    chunks = [c for band in plan_bands(12, 2, 3, spec.chunk_elements, tile.rows, tile.cols) for c in band]
    for name, run in (("job", lambda: run_tile(np.ones((12, 2), dtype=np.float32), spec, tile, OBJECTIVES["sum"])),
                      ("v1", lambda: list(executor.PassOne(executor.SerialExecutor(), torch.ones(12, 2), 3,
                                                           spec.chunk_elements, OBJECTIVES["sum"], 5.0)))):
        calls = []

        def counted(*args):
            calls.append(args[1])
            return real(*args)
        monkeypatch.setattr(executor, "chunk_gradients", counted)
        run()
        monkeypatch.setattr(executor, "chunk_gradients", real)
        assert calls == chunks, name


def test_band_of_mismatched_rows_is_refused():
    spec = spec_for(12, 2, 3, "sum", "float32")
    tiles = plan_tiles(12, 2, 3, 1, tile_numbers=1, least_numbers=1)
    parts = [run_tile(np.ones((12, 2), dtype=np.float32), spec, tile, OBJECTIVES["sum"]) for tile in tiles[:2]]
    assert parts[0].rows == parts[1].rows  # one tile row: one row band, two column bands
    assert add_band(ROWS, *parts).sums.shape == (4, 2)
    with pytest.raises(ValueError):
        add_band(COLS, *parts)


def test_plan_tiles_keeps_every_worker_busy_without_tiny_tiles():
    # N = 1024, D = 64, F = 16: 134M numbers, 4 tiles of 34M (not 9 of 15M) for 2 workers.
    assert [t.blocks for t in plan_tiles(1024, 64, 16, 2)] == [64] * 4
    # N = 65,536, D = 64, F = 256: tiles of 8 x 8 blocks, 537M numbers each.
    large = plan_tiles(65536, 64, 256, 2)
    assert len(large) == 32 * 32 and large[0].blocks == 64
    assert sum(t.blocks for t in large) == 256 ** 2
    assert len(plan_tiles(64, 2, 4, 3)) >= 3  # tiny, but one tile per worker at least
    # One pair per block (D = 1, factor = N = 131,072): a tile's losses, held while it runs, are
    # at most 2048 x 2048 numbers (32 MiB of float64), not 16,384 x 16,384 (2 GiB) of pairs' numbers.
    amplifying = plan_tiles(131072, 1, 131072, 2)
    assert {t.blocks for t in amplifying} == {2048 * 2048} and len(amplifying) == 64 * 64
