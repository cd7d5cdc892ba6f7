"""Python client for the blockgrad service.

    from blockgrad_client import Client, BlockgradError

    with Client("http://127.0.0.1:8000", token=None, timeout=120) as client:
        result = client.gradients(vectors, factor=2, outputs=["blocks", "accumulated"])
        tensors = client.infer(vectors, factor=2)   # /v2, binary tensors both ways

Depends on numpy, requests and ijson only (no torch, no Flask).
"""
from .client import Client
from .errors import BlockgradError
from .gradients import Block, GradientResult
from .jobs import Job

__all__ = ["Client", "BlockgradError", "Block", "GradientResult", "Job"]
__version__ = "0.1.0"
