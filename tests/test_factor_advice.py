"""The cost model and the 413's suggested factor (issue 10): the advice fits every limit, is
the cheapest the model knows, and following it gives a 200. Costs that decide a verdict are
pinned through the settings, so nothing here depends on the machine's speed."""
import itertools

import pytest

from app import create_app
from app.core.admission import COMPUTE_COSTS, OUTPUT_COSTS, check_block_and_answer, predict_seconds, suggested_factor
from app.core.errors import BlockgradError
from app.core.request import Sizes
from app.core.settings import Settings

from .test_api import assert_error, post
from .test_v2 import assert_protocol_error

PINNED = Settings(cost_per_block_s=1e-3, cost_per_number_s=1e-9)


def largest_side(n, factor):  # written out again: the last block takes the remainder
    base = n // factor
    return max(base, n - (factor - 1) * base)


def fits(n, dim, factor, outputs, max_block, max_output):
    answer = {"blocks": n * n * 2 * dim, "accumulated": n * dim, "losses": factor * factor}
    return (largest_side(n, factor) ** 2 * 2 * dim <= max_block
            and sum(answer[o] for o in outputs) <= max_output)


def test_pinned_costs_give_the_literal_formula():
    n, dim, factor = 100, 8, 7
    entries = n * n * 2 * dim  # every block's entries
    # Each block's row and column sums, (h + w) x D: 36 blocks 14 x 14, 12 of 14 x 16 or 16 x 14, one 16 x 16.
    sums = (36 * (14 + 14) + 12 * (14 + 16) + (16 + 16)) * dim
    assert sums == factor * n * 2 * dim
    compute = factor ** 2 * 1e-3 + (entries + sums) * 1e-9
    assert predict_seconds(Sizes(n, dim, factor, ("accumulated",), "logsumexp", "float64"), PINNED) == pytest.approx(compute)
    # Blocks of a dense objective past the keep budget: pass two recomputes them, and they are written.
    small_keep = Settings(cost_per_block_s=1e-3, cost_per_number_s=1e-9, max_block_elements=1000)
    written = factor ** 2 * 1e-3 + entries * 1e-9
    assert predict_seconds(Sizes(n, dim, factor, ("blocks",), "sum_of_squares", "float32"), small_keep) == \
        pytest.approx(2 * compute + written)
    # sum's gradients are kept from pass one: no recompute, only the writing.
    assert predict_seconds(Sizes(n, dim, factor, ("blocks",), "sum", "float32"), small_keep) == \
        pytest.approx(compute + written)


def test_the_table_covers_every_objective_and_dtype_and_grows_with_the_work():
    from app.core.objectives import OBJECTIVES
    assert set(COMPUTE_COSTS) == {(o, d) for o in OBJECTIVES for d in ("float32", "float64")}
    assert set(OUTPUT_COSTS) == {"float32", "float64"}
    settings = Settings()
    for objective, dtype in COMPUTE_COSTS:
        small = predict_seconds(Sizes(512, 64, 8, ("accumulated",), objective, dtype), settings)
        assert 0 < small < predict_seconds(Sizes(1024, 64, 8, ("accumulated",), objective, dtype), settings)
        assert small < predict_seconds(Sizes(512, 64, 86, ("accumulated",), objective, dtype), settings)
        assert small < predict_seconds(Sizes(512, 64, 8, ("blocks", "accumulated"), objective, dtype), settings)


def test_cost_settings_come_from_the_environment():
    settings = Settings.from_env({"BLOCKGRAD_COST_PER_BLOCK_S": "2e-6", "BLOCKGRAD_COST_PER_NUMBER_S": "3e-9"})
    assert (settings.cost_per_block_s, settings.cost_per_number_s) == (2e-6, 3e-9)
    assert Settings.from_env({}).cost_per_block_s is None
    with pytest.raises(ValueError, match="BLOCKGRAD_COST_PER_NUMBER_S"):
        Settings.from_env({"BLOCKGRAD_COST_PER_NUMBER_S": "fast"})


GRID = list(itertools.product(
    [1, 7, 37, 100],  # N
    [1, 3],  # D
    [("accumulated",), ("accumulated", "losses"), ("blocks", "accumulated", "losses")],
    [6, 50, 2000],  # BLOCKGRAD_MAX_BLOCK_ELEMENTS
    [60, 500, 10 ** 6],  # BLOCKGRAD_MAX_OUTPUT_ELEMENTS
))


@pytest.mark.parametrize("pinned", [True, False])
def test_suggested_factor_fits_every_limit_and_has_the_fewest_blocks(pinned):
    for n, dim, outputs, max_block, max_output in GRID:
        costs = dict(cost_per_block_s=1e-3, cost_per_number_s=1e-9) if pinned else {}
        settings = Settings(max_block_elements=max_block, max_output_elements=max_output, **costs)
        fitting = [f for f in range(1, n + 1) if fits(n, dim, f, outputs, max_block, max_output)]
        suggested = suggested_factor(Sizes(n, dim, None, outputs, "logsumexp", "float64"), settings)
        case = (n, dim, outputs, max_block, max_output)
        if not fitting:
            assert suggested is None, case
            continue
        assert suggested in fitting, case
        # Every block here is far within one chunk (at most 2000 numbers), where each further
        # block only adds work (its overhead, its row and column sums, a loss): the fastest
        # factor is the fitting one with the fewest blocks, whatever the cost table says.
        assert suggested == min(fitting), case


def test_the_advice_is_the_factor_with_the_fewest_blocks_not_the_next_larger():
    # Issue 10: N=1000, factor 334 used to be told "factor 499" (249,001 blocks, past the deadline).
    with pytest.raises(BlockgradError) as refused:
        check_block_and_answer(Sizes(1000, 64, 334, ("accumulated",)), Settings())
    details = refused.value.details
    assert details["limit"] == "BLOCKGRAD_MAX_BLOCK_ELEMENTS"
    # Side at most 181 (181^2 x 128 <= 4M) fits from factor 6, but blocks over a chunk (1M numbers:
    # side 90) are charged twice: factor 12 (base 83, last 87) has the fewest blocks within a chunk.
    assert details["suggested_factor"] == 12
    assert "factor 12 fits" in refused.value.message


def test_default_factor_refused_then_the_suggested_one_answers():
    # N=200, default factor 34: base 5, last block 35 rows, 35^2 x 16 = 19,600 numbers.
    client = create_app({"BLOCKGRAD_MAX_BLOCK_ELEMENTS": 2000, "BLOCKGRAD_COST_PER_BLOCK_S": "1e-3",
                         "BLOCKGRAD_COST_PER_NUMBER_S": "1e-9"}).test_client()
    vectors = [[0.25 * i, -1.0, 2.0, 0.5, 1.0, 3.0, -2.0, 0.0] for i in range(200)]
    error = assert_error(client.post("/v1/gradients", json={"vectors": vectors, "outputs": ["accumulated"]}),
                         413, "limit_exceeded")
    suggested = error["details"]["suggested_factor"]
    assert f"factor {suggested} fits" in error["message"]
    assert largest_side(200, suggested) ** 2 * 16 <= 2000
    response, body = post(client, {"vectors": vectors, "factor": suggested, "outputs": ["accumulated"]})
    assert response.status_code == 200 and body["factor"] == suggested


def test_answer_limit_on_the_losses_suggests_a_smaller_factor():
    # N=200, D=8: accumulated 1,600 numbers + losses F^2; 1,700 allowed -> F <= 10.
    client = create_app({"BLOCKGRAD_MAX_OUTPUT_ELEMENTS": 1700}).test_client()
    body = {"vectors": [[1.0] * 8] * 200, "factor": 20, "outputs": ["accumulated", "losses"]}
    error = assert_error(client.post("/v1/gradients", json=body), 413, "limit_exceeded")
    assert error["details"]["limit"] == "BLOCKGRAD_MAX_OUTPUT_ELEMENTS"
    suggested = error["details"]["suggested_factor"]
    assert suggested ** 2 + 1600 <= 1700 and f"factor {suggested} fits" in error["message"]
    response, _ = post(client, dict(body, factor=suggested))
    assert response.status_code == 200


def test_no_suggestion_when_no_factor_fits_and_the_message_says_what_else_to_change():
    # The blocks alone (30 x 30 x 4 = 3,600 numbers) are over the answer limit at every factor.
    client = create_app({"BLOCKGRAD_MAX_BLOCK_ELEMENTS": 100, "BLOCKGRAD_MAX_OUTPUT_ELEMENTS": 1000}).test_client()
    body = {"vectors": [[1.0, 2.0]] * 30, "factor": 1, "outputs": ["blocks"]}
    error = assert_error(client.post("/v1/gradients", json=body), 413, "limit_exceeded")
    assert "suggested_factor" not in error["details"]
    assert "fewer outputs" in error["message"]
    # Output limit, blocks asked: no factor changes the blocks' size.
    error = assert_error(client.post("/v1/gradients", json=dict(body, factor=10)), 413, "limit_exceeded")
    assert error["details"]["limit"] == "BLOCKGRAD_MAX_OUTPUT_ELEMENTS" and "suggested_factor" not in error["details"]


def test_v2_refusal_names_the_factor_and_following_it_answers():
    client = create_app({"BLOCKGRAD_MAX_BLOCK_ELEMENTS": 2000}).test_client()
    data = [float(i % 7) for i in range(200 * 8)]
    document = {"inputs": [{"name": "vectors", "shape": [200, 8], "datatype": "FP32", "data": data}],
                "outputs": [{"name": "accumulated"}]}
    message = assert_protocol_error(client.post("/v2/models/blockgrad/infer", json=document), 413)
    suggested = int(message.split("; factor ")[1].split(" fits")[0])
    assert largest_side(200, suggested) ** 2 * 16 <= 2000
    response = client.post("/v2/models/blockgrad/infer", json=dict(document, parameters={"factor": suggested}))
    assert response.status_code == 200
