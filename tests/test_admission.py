"""Admission control refuses from the sizes alone: nothing is allocated or computed."""
import pytest

import app.core.run as compute
import app.core.engine as engine

from .test_api import GOOD, assert_error, assert_still_serving


@pytest.fixture
def no_compute(monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError("a refused request reached the engine")
    for module, name in [(compute, "load_vectors"), (compute, "pass_one"), (engine, "pair_blocks"), (engine, "chunk_gradients")]:
        monkeypatch.setattr(module, name, must_not_run)


@pytest.mark.parametrize("body,limit", [
    ({"vectors": [[0.0]] * 9000}, "BLOCKGRAD_MAX_N"),
    ({"vectors": [[0.0] * 5000]}, "BLOCKGRAD_MAX_D"),
    ({"vectors": [[0.0]] * 8192, "factor": 1, "outputs": ["accumulated"]}, "BLOCKGRAD_MAX_BLOCK_ELEMENTS"),
    ({"vectors": [[0.0] * 4] * 8192, "factor": 4096}, "BLOCKGRAD_MAX_OUTPUT_ELEMENTS"),
])
def test_large_requests_are_refused_without_computing(client, no_compute, monkeypatch, body, limit):
    error = assert_error(client.post("/v1/gradients", json=body), 413, "limit_exceeded")
    assert error["details"]["limit"] == limit
    assert error["details"]["value"] > error["details"]["allowed"]
    monkeypatch.undo()
    assert_still_serving(client)


def test_a_good_request_does_reach_the_engine(client, no_compute):
    """The fixture really blocks the engine, so the refusals above prove something."""
    assert_error(client.post("/v1/gradients", json=GOOD), 500, "internal_error")
