"""A request that may spread over several compute slots: admission reserves memory for the
most slots it may take (BLOCKGRAD_SLOTS_PER_REQUEST or all of them) and predicts its time at
one; served on several slots in process, the numbers are the reference's."""
import numpy as np
import orjson
import pytest
import torch

from app import create_app
from app.api.v1.gradients import answer_cost
from app.core import host
from app.core.admission import admit, predict_peak_bytes
from app.core.settings import Settings
from app.core.request import Sizes
from app.core.slots import ThreadSlots
from app.extensions import services_of
from tools.reference import reference_accumulated

from .test_api import assert_error

MIB = 2 ** 20
LANES = 8
# 8 chunks of 256K numbers when parallel, one 2M chunk serially.
SIZES = Sizes(256, 16, 16, ("accumulated",), "sum", "float32")


@pytest.fixture
def eight_slots(monkeypatch):
    """The app built as a gunicorn worker builds it, on a pod of LANES slots (threads here)."""
    monkeypatch.setattr(host, "slots", ThreadSlots(LANES))


def test_more_lanes_reserve_more_memory_and_the_same_time():
    settings, cost = Settings(), answer_cost(0, "float32")
    one, many = admit(SIZES, cost, settings, 1), admit(SIZES, cost, settings, LANES)
    assert many.bytes > one.bytes  # each lane's chunk, the chunks computed ahead, partial gradients
    assert many.seconds == one.seconds  # time at one slot: the conservative case
    # No more lanes than chunks: a request of one block (one chunk) costs no more on many slots.
    lone_block = Sizes(64, 16, 1, ("accumulated",), "sum", "float32")
    assert predict_peak_bytes(lone_block, cost, settings, LANES) == predict_peak_bytes(lone_block, cost, settings, 1)


def budget_between(settings: Settings) -> tuple[int, dict]:
    """A worker budget that the request fits on one slot and not on LANES."""
    body = {"vectors": np.zeros((SIZES.n, SIZES.dim)).tolist(), "factor": SIZES.factor, "outputs": ["accumulated"],
            "dtype": "float32", "objective": "sum"}
    cost = answer_cost(len(orjson.dumps(body)), "float32")
    one = predict_peak_bytes(SIZES, cost, settings, 1)
    many = predict_peak_bytes(SIZES, cost, settings, LANES)
    assert many - one > 4 * MIB, (one, many)  # room between them for the body's own rounding
    return (one + many) // 2, body


def test_the_reservation_is_for_the_most_slots_a_request_may_take(eight_slots):
    budget, body = budget_between(Settings())
    app = create_app({"TESTING": True, "BLOCKGRAD_WORKER_MEMORY_BYTES": str(budget)})
    assert services_of(app).executor.most_lanes == LANES
    error = assert_error(app.test_client().post("/v1/gradients", json=body), 413, "limit_exceeded")
    assert error["details"]["limit"] == "BLOCKGRAD_WORKER_MEMORY_BYTES"
    # Capped at one slot a request, the same request fits and is served.
    capped = create_app({"TESTING": True, "BLOCKGRAD_WORKER_MEMORY_BYTES": str(budget),
                         "BLOCKGRAD_SLOTS_PER_REQUEST": "1"})
    assert services_of(capped).executor.most_lanes == 1
    assert capped.test_client().post("/v1/gradients", json=body).status_code == 200


def test_a_request_on_several_slots_gives_the_reference_numbers(eight_slots):
    app = create_app({"TESTING": True})
    executor = services_of(app).executor
    assert executor.parallel and executor.most_lanes == LANES
    rng = np.random.default_rng(7)
    vectors = rng.standard_normal((300, 12))
    body = {"vectors": vectors.tolist(), "factor": 15, "outputs": ["blocks", "accumulated", "losses"],
            "dtype": "float64", "objective": "logsumexp", "offset": 1.0}
    response = app.test_client().post("/v1/gradients", json=body)
    assert response.status_code == 200, response.get_data()[:300]
    expected = reference_accumulated(torch.tensor(vectors), 15, "logsumexp", 1.0).numpy()
    np.testing.assert_allclose(np.asarray(response.json["accumulated"]), expected, rtol=1e-12, atol=1e-12)
    assert services_of(app).gate.source.busy == 0  # every slot given back


def reserved_bytes(app, monkeypatch, body: dict) -> int:
    """The bytes the pipeline reserved for `body`'s prediction (what the ledger then holds)."""
    from app.http import pipeline

    held, real = [], pipeline.reserve_for_request
    monkeypatch.setattr(pipeline, "reserve_for_request",
                        lambda ledger, nbytes, **where: (held.append(nbytes), real(ledger, nbytes, **where))[1])
    assert app.test_client().post("/v1/gradients", json=body).status_code == 200
    monkeypatch.setattr(pipeline, "reserve_for_request", real)
    assert len(held) == 1
    assert services_of(app).ledger.reserved == 0  # given back with the answer
    return held[0]


@pytest.mark.parametrize("factor,chunks", [(2, 1), (3, 4)])
def test_the_reservation_follows_the_lanes_a_request_may_take(eight_slots, monkeypatch, factor, chunks):
    """The seed's 10 x 5 example is one chunk at its default factor 2 (inline, one lane): it
    reserves what it does on one slot. At factor 3 the remainder blocks make four chunks of
    another shape, which four lanes may compute at once: it reserves for four, not eight."""
    from app.core.engine import PARALLEL_CHUNK_ELEMENTS, plan_bands

    assert sum(len(band) for band in plan_bands(10, 5, factor, PARALLEL_CHUNK_ELEMENTS)) == chunks
    body = {"vectors": np.arange(50.0).reshape(10, 5).tolist(), "factor": factor, "outputs": ["accumulated"]}
    on_eight = reserved_bytes(create_app({"TESTING": True}), monkeypatch, body)
    on_one = reserved_bytes(create_app({"TESTING": True, "BLOCKGRAD_SLOTS_PER_REQUEST": "1"}), monkeypatch, body)
    capped = reserved_bytes(create_app({"TESTING": True, "BLOCKGRAD_SLOTS_PER_REQUEST": str(chunks)}), monkeypatch,
                            body)
    assert on_eight == capped  # no more lanes than chunks
    if chunks == 1:
        assert on_eight == on_one
    else:
        assert on_eight > on_one
