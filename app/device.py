"""Which torch device this worker computes on, chosen once per process.

Resolved lazily on first use, so that gunicorn's master never creates a CUDA
context before it forks the workers.
"""
import functools

import torch


@functools.cache
def resolve_device(setting: str) -> torch.device:
    """auto | cpu | cuda | cuda:N -> a usable torch.device, or ValueError."""
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(setting)
    except RuntimeError:
        raise ValueError(f"BLOCKGRAD_DEVICE must be auto, cpu, cuda or cuda:N, got {setting!r}") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise ValueError(f"BLOCKGRAD_DEVICE must be auto, cpu, cuda or cuda:N, got {setting!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"BLOCKGRAD_DEVICE={setting} but CUDA is not available in this process")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"BLOCKGRAD_DEVICE={setting} but only {torch.cuda.device_count()} CUDA devices exist")
    return device

