"""Device out of memory: 503 device_out_of_memory, cache freed, the worker serves on."""
import pytest
import torch

import app.compute as compute
import app.device as device

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


@pytest.mark.parametrize("where", ["app.views.gradients.load_vectors", "app.compute.iter_blocks"])
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


def test_out_of_memory_mid_stream_frees_the_cache(client, monkeypatch, empty_cache_calls):
    real = compute.iter_blocks
    calls = []

    def fail_in_pass_two(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # pass two, while the body streams
            raise_oom()
        return real(*args, **kwargs)
    monkeypatch.setattr(compute, "iter_blocks", fail_in_pass_two)
    response = client.post("/v1/gradients", json=GOOD)
    assert response.status_code == 200
    with pytest.raises(torch.OutOfMemoryError):
        response.get_data()
    assert empty_cache_calls
    monkeypatch.undo()
    assert_still_serving(client)
