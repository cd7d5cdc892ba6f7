"""The memory budget against real gunicorn (issue 11): a worker's measured peak (/proc VmHWM,
reset before the request) stays within the admission's prediction, and a request predicted
over the budget is refused without growing the worker."""
import pytest

from app.core.settings import Settings
from bench.memory import Case, measure
from tools.server import gunicorn_server

pytestmark = pytest.mark.slow

MIB = 2 ** 20
BUDGET = 900 * MIB  # the admitted cases predict ~730 and ~410 MiB (heap slack included), the refused one ~1.4 GiB
ENV = {"BLOCKGRAD_WORKER_MEMORY_BYTES": str(BUDGET), "BLOCKGRAD_COST_PER_BLOCK_S": "1e-15",
       "BLOCKGRAD_COST_PER_NUMBER_S": "1e-15"}  # compute admission never in the way here
ADMITTED = [
    Case("v1 all f64 logsumexp", 400, 64, 4, "logsumexp", "float64", ("blocks", "accumulated", "losses"), "v1_json"),
    Case("v2 binary grid f32", 512, 32, 8, "l2_norm", "float32", ("block_gradients:binary", "losses:json"),
         "v2_binary"),
]
# The case: block_gradients as JSON beside binary bounds, FP64 1024 x 32: ~1.1 GB predicted.
REFUSED = Case("v2 mixed f64", 1024, 32, 8, "logsumexp", "float64", ("block_gradients:json", "bounds:binary"),
               "v2_binary")


@pytest.fixture(scope="module")
def server():
    with gunicorn_server(workers=1, env=ENV) as server:
        yield server


@pytest.mark.parametrize("case", ADMITTED, ids=lambda case: case.name)
def test_measured_peak_is_within_the_prediction_and_the_budget(server, case):
    settings = Settings.from_env(ENV)
    peak, predicted, status, _ = measure(server, case, settings)
    assert status == 200
    assert predicted <= BUDGET
    # Measured as here (bench.memory.measure, ENV, 2 cores): 179 and 33 MiB against 726 and 324
    # MiB predicted; with app.core.heap.watch_for returning None (no heap watch), 232 and 38 MiB.
    assert peak <= predicted, f"measured {peak / MIB:.0f} MiB over the predicted {predicted / MIB:.0f} MiB"


def test_over_the_budget_is_refused_without_growing_the_worker(server):
    settings = Settings.from_env(ENV)
    peak, predicted, status, _ = measure(server, REFUSED, settings)
    assert predicted > BUDGET and status == 413
    # The body and its parsed header, nothing computed: admitted (a 64 GiB budget), the same
    # request added 660 MiB (668 MiB without the heap watch).
    assert peak < 64 * MIB
