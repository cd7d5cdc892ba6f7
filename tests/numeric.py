"""One comparison of the service's numbers with the reference's, used by every test that makes one.

Per entry and relative: |actual - expected| <= rtol * (|expected| + floor). The floor is
the dtype's smallest normal number by default (below it precision is lost to
subnormals), so a gradient of 1e-4 is held to 1e-4 * rtol and a tiny but non-zero one
(9.6e-23) is not passed as 0. Where an entry is a sum of terms that may cancel (a model's
weights), pass `scale`, the size of those terms: it is added to the floor.

A whole-tensor absolute tolerance (the old rtol=atol=2e-5) let a 16% error through on
entries of 1.2e-4 (mean at N = 37); this does not.
"""
import math
from decimal import Decimal

import numpy as np
import torch

RTOL = {"float32": 2e-5, "float64": 1e-12}
NAMES = {torch.float32: "float32", torch.float64: "float64", np.float32: "float32", np.float64: "float64",
         "FP32": "float32", "FP64": "float64", "float32": "float32", "float64": "float64"}


def as_array(value) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().to(torch.float64).numpy()
    return np.asarray(value, dtype=np.float64)


def mismatches(actual, expected, dtype, *, scale=None, rtol=None) -> np.ndarray:
    """Boolean array, True where `actual` is not within the tolerance of `expected`."""
    name = NAMES[dtype]
    rtol = RTOL[name] if rtol is None else rtol
    actual, expected = as_array(actual), as_array(expected)
    assert actual.shape == expected.shape, f"shape {actual.shape} != expected {expected.shape}"
    assert np.isfinite(expected).all(), "the oracle itself is not finite here: fix the oracle, not the check"
    floor = float(np.finfo(name).smallest_normal) + (0.0 if scale is None else as_array(scale))
    assert np.isfinite(floor).all(), "an infinite scale would pass anything"
    bad = ~np.isfinite(actual)
    # rtol applied to each part before they are added: |expected| + scale may pass the largest
    # float64 (a loss of 1.7e308), and an infinite tolerance would pass anything.
    with np.errstate(invalid="ignore", over="ignore"):
        bad |= ~(np.abs(actual - expected) <= rtol * np.abs(expected) + rtol * floor)
    return bad


def assert_matches(actual, expected, dtype, *, scale=None, rtol=None, what: str = "") -> None:
    """Every entry of `actual` within the relative tolerance of `dtype` of `expected` (see the module)."""
    bad = mismatches(actual, expected, dtype, scale=scale, rtol=rtol)
    if bad.any():
        a, e = as_array(actual), as_array(expected)
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise AssertionError(f"{what or 'values'}: {int(bad.sum())} of {bad.size} entries off the reference "
                             f"(rtol {RTOL[NAMES[dtype]] if rtol is None else rtol}); first at {where}: "
                             f"{a[where]!r} vs expected {e[where]!r}")


def assert_near_exact(actual: float, exact: Decimal, dtype, what: str = "") -> None:
    """One number against an exact (Decimal) answer: the same rtol, with the floor the dtype's
    smallest subnormal, its grid's unit, since an exact reference leaves no other slack (the
    floor of `mismatches` would pass any subnormal answer)."""
    name = NAMES[dtype]
    tiny = Decimal(float(np.finfo(name).smallest_subnormal))
    error = abs(Decimal(float(actual)) - exact)
    assert error <= Decimal(RTOL[name]) * abs(exact) + tiny, f"{what}: {actual!r} vs exact {exact:.8e}"


def largest(expected) -> float:
    """max |expected|: the `scale` for entries that are sums of terms that cancel (a model's
    gradient), whose error is relative to the tensor's size rather than to each entry."""
    return float(np.abs(as_array(expected)).max(initial=0.0))


def loss_terms(block: torch.Tensor, objective: str, offset: float = 5.0) -> float:
    """How big the terms summed into a built-in objective's loss of `block` are: the `scale`
    for comparing that loss (sum(B + offset) near 0 from terms of 1e3 is exact only to their size)."""
    block = block.detach().to(torch.float64)
    if objective == "sum":
        return (block + offset).abs().sum().item()
    if objective == "mean":
        return block.abs().sum().item() / block.numel()
    if objective == "logsumexp":
        return block.max().abs().item() + math.log(block.numel())
    if objective == "sum_of_squares":
        return (block * block).sum().item()
    if objective == "l2_norm":
        largest = block.abs().max().item()
        return largest * torch.linalg.vector_norm(block / largest).item() if largest > 0 else 0.0
    raise ValueError(objective)
