"""Which torch device this worker computes on, chosen once per process.

Resolved lazily on first use, so that gunicorn's master never creates a CUDA
context before it forks the workers.
"""
import functools
import gc
import threading
import time
import traceback

import torch

from .errors import not_ready


@functools.cache
def resolve_device(setting: str) -> torch.device:
    """auto | cpu | cuda | cuda:N -> a usable torch.device (CUDA always with its index), or ValueError."""
    if setting == "auto":
        setting = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(setting)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"BLOCKGRAD_DEVICE must be auto, cpu, cuda or cuda:N, got {setting!r}")
    if device.type == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"BLOCKGRAD_DEVICE={setting} but CUDA is not available in this process")
    if device.index is None:  # answers and metrics name the card: cuda:0, not cuda
        return torch.device("cuda", torch.cuda.current_device())
    if device.index >= torch.cuda.device_count():
        raise ValueError(f"BLOCKGRAD_DEVICE={setting} but only {torch.cuda.device_count()} CUDA devices exist")
    return device


def usable_device(setting: str) -> torch.device:
    """The configured device, once it has run a small computation; not_ready if it cannot."""
    try:
        device = resolve_device(setting)
        probe = torch.ones(2, device=device).sum().item()
    except (ValueError, RuntimeError) as exc:
        raise not_ready(str(exc)) from None
    if probe != 2.0:
        raise not_ready("it gave a wrong answer to a probe computation.")
    return device


def release_device_memory(exc: BaseException) -> None:
    """Drop the failed request's tensors (held by the traceback's frames) and hand
    the allocator's cached blocks back, so this worker can serve the next request."""
    traceback.clear_frames(exc.__traceback__)
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


READY_RECHECK_S = 10.0  # a failed check is retried at most this often (e.g. a GPU that comes back)
_ready_lock = threading.Lock()
_ready: dict[str, tuple[float, torch.device | Exception]] = {}


def ready_device(setting: str) -> torch.device:
    """usable_device, checked once per process and cached: a probe answers from memory,
    never waits for a device computation (nor for a busy worker's compute slot).
    A failure is cached too, and checked again after READY_RECHECK_S."""
    now = time.monotonic()
    with _ready_lock:
        cached = _ready.get(setting)
        if cached is None or (isinstance(cached[1], Exception) and now - cached[0] > READY_RECHECK_S):
            try:
                outcome: torch.device | Exception = usable_device(setting)
            except Exception as exc:  # noqa: BLE001 - cached and raised to every caller
                outcome = exc
            cached = _ready[setting] = (now, outcome)
    if isinstance(cached[1], Exception):
        raise cached[1]
    return cached[1]
