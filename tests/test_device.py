"""BLOCKGRAD_DEVICE resolution, on any machine (CUDA's answers are stubbed where absent)."""
import pytest
import torch

from app.core.device import resolve_device

from tools.reference import batch_matrix, concat_matrix, reference_accumulated, reference_blocks

from .numeric import assert_matches, loss_terms

resolve = resolve_device.__wrapped__  # the uncached function: each test sets its own CUDA


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize("setting,expected", [("auto", "cuda:0"), ("cuda", "cuda:0"), ("cuda:1", "cuda:1"),
                                              ("cpu", "cpu")])
def test_with_cuda(two_gpus, setting, expected):
    assert str(resolve(setting)) == expected


@pytest.mark.parametrize("setting", ["cuda:2", "tpu", "mps", "gpu", ""])
def test_refused_with_cuda(two_gpus, setting):
    with pytest.raises(ValueError, match="BLOCKGRAD_DEVICE"):
        resolve(setting)


def test_without_cuda(no_gpu):
    assert str(resolve("auto")) == "cpu" and str(resolve("cpu")) == "cpu"
    for setting in ("cuda", "cuda:0"):
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve(setting)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_api_on_cuda_matches_cpu_and_the_seed_loops():
    """Both devices' answers against the literal loops (CPU, float64), under numeric.py."""
    from app import create_app
    vectors = torch.randn(23, 4, dtype=torch.float64)
    body = {"vectors": vectors.tolist(), "factor": 4, "dtype": "float64",
            "objective": "logsumexp", "outputs": ["blocks", "accumulated", "losses"]}
    expected = reference_blocks(vectors, 4, "logsumexp")
    inputs = batch_matrix(concat_matrix(vectors), factor=4)
    scales = [loss_terms(block, "logsumexp") for block in inputs]
    for device, name in (("cpu", "cpu"), ("cuda", "cuda:0")):
        response = create_app({"TESTING": True, "BLOCKGRAD_DEVICE": device}).test_client().post("/v1/gradients",
                                                                                              json=body)
        assert response.status_code == 200, response.get_data()
        answer = response.get_json()
        assert answer["device"] == name
        assert_matches(answer["accumulated"], reference_accumulated(vectors, 4, "logsumexp"), "float64",
                       what=f"{name} accumulated")
        assert_matches(answer["losses"], torch.stack([loss for loss, _ in expected]).reshape(4, 4), "float64",
                       scale=torch.tensor(scales).reshape(4, 4), what=f"{name} losses")
        assert len(answer["blocks"]) == 16
        for k, (block, (_, grad)) in enumerate(zip(answer["blocks"], expected, strict=True)):
            assert (block["row"], block["col"]) == divmod(k, 4)
            assert_matches(block["gradient"], grad, "float64", what=f"{name} block {k} gradient")


def test_readiness_is_checked_once_and_cached(monkeypatch):
    """Probes answer from memory: the device computation runs once per process."""
    import app.core.device as device_module

    calls = []
    monkeypatch.setattr(device_module, "_ready", {})
    monkeypatch.setattr(device_module, "usable_device", lambda setting: calls.append(setting) or torch.device("cpu"))
    for _ in range(5):
        assert device_module.ready_device("cpu") == torch.device("cpu")
    assert calls == ["cpu"]
