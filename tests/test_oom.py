"""Device out of memory: 503 device_out_of_memory, cache freed, the worker serves on."""
import pytest
import torch

import app.core.device as device
import app.core.run as compute
from app.core.errors import BlockgradError

from .test_api import GOOD, assert_error, assert_still_serving


@pytest.fixture
def empty_cache_calls(monkeypatch):
    """Pretend CUDA is in use and count empty_cache calls (no GPU needed)."""
    calls = []
    monkeypatch.setattr(device.torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(device.torch.cuda, "empty_cache", lambda: calls.append(1))
    return calls


def raise_oom(*args, **kwargs):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


@pytest.mark.parametrize("where", ["app.core.run.load_vectors", "app.core.run.plan_bands"])  # pass one's plan
def test_out_of_memory_is_503_and_the_worker_serves_on(client, monkeypatch, empty_cache_calls, where):
    monkeypatch.setattr(where, raise_oom)
    response = client.post("/v1/gradients", json=GOOD)
    error = assert_error(response, 503, "device_out_of_memory")
    assert int(response.headers["Retry-After"]) >= 1
    assert "Tried to allocate" not in error["message"]  # no internals in the body
    assert empty_cache_calls
    monkeypatch.undo()
    assert_still_serving(client)


def test_cuda_out_of_memory_is_the_same_class():
    assert torch.cuda.OutOfMemoryError is torch.OutOfMemoryError


def test_out_of_memory_mid_stream_frees_the_cache(monkeypatch, empty_cache_calls):
    from app import create_app
    # Dense gradients over a tiny keep budget: pass one cannot keep them, so pass two runs.
    client = create_app({"TESTING": True, "BLOCKGRAD_MAX_BLOCK_ELEMENTS": 16}).test_client()
    real = compute.chunk_gradients
    calls = []

    def fail_in_pass_two(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:  # pass two's first band, while the body streams
            raise_oom()
        return real(*args, **kwargs)
    response = client.post("/v1/gradients", json=dict(GOOD, objective="sum_of_squares"))
    assert response.status_code == 200
    monkeypatch.setattr(compute, "chunk_gradients", fail_in_pass_two)  # pass one is over: the head was sent
    with pytest.raises(BlockgradError) as cut:
        response.get_data()
    assert cut.value.code == "device_out_of_memory"
    assert empty_cache_calls
    monkeypatch.undo()
    assert_still_serving(client)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_cuda_out_of_memory_frees_the_cache_and_serves_on():
    from app import create_app
    client = create_app({"TESTING": True, "BLOCKGRAD_DEVICE": "cuda",
                         "BLOCKGRAD_MAX_BLOCK_ELEMENTS": 2 ** 28}).test_client()
    assert_still_serving(client)  # creates the CUDA context outside the cap
    cap = 64 * 2 ** 20
    torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(0).total_memory)
    try:
        # One 1024 x 1024 x 128 float32 block is 512 MiB: far over the 64 MiB cap.
        body = {"vectors": [[1.0] * 64] * 1024, "factor": 1, "outputs": ["accumulated"]}
        response = client.post("/v1/gradients", json=body)
        assert_error(response, 503, "device_out_of_memory")
        assert torch.cuda.memory_reserved() < cap  # nothing of the request is cached any more
        assert_still_serving(client)  # the same process, right after
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
