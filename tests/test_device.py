"""BLOCKGRAD_DEVICE resolution, on any machine (CUDA's answers are stubbed where absent)."""
import pytest
import torch

from app.core.device import resolve_device

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
def test_api_on_cuda_matches_cpu():
    from app import create_app
    body = {"vectors": torch.randn(23, 4, dtype=torch.float64).tolist(), "factor": 4, "dtype": "float64",
            "objective": "logsumexp", "outputs": ["blocks", "accumulated", "losses"]}
    cpu = create_app({"TESTING": True, "BLOCKGRAD_DEVICE": "cpu"}).test_client().post("/v1/gradients", json=body)
    gpu = create_app({"TESTING": True, "BLOCKGRAD_DEVICE": "cuda"}).test_client().post("/v1/gradients", json=body)
    assert cpu.status_code == gpu.status_code == 200
    cpu_body, gpu_body = cpu.get_json(), gpu.get_json()
    assert gpu_body["device"] == "cuda:0" and cpu_body["device"] == "cpu"
    torch.testing.assert_close(torch.tensor(gpu_body["accumulated"]), torch.tensor(cpu_body["accumulated"]))
    for a, b in zip(gpu_body["blocks"], cpu_body["blocks"]):
        torch.testing.assert_close(torch.tensor(a["gradient"]), torch.tensor(b["gradient"]))


def test_readiness_is_checked_once_and_cached(monkeypatch):
    """Probes answer from memory: the device computation runs once per process."""
    import app.core.device as device_module

    calls = []
    monkeypatch.setattr(device_module, "_ready", {})
    monkeypatch.setattr(device_module, "usable_device", lambda setting: calls.append(setting) or torch.device("cpu"))
    for _ in range(5):
        assert device_module.ready_device("cpu") == torch.device("cpu")
    assert calls == ["cpu"]
