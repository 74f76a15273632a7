"""Test helpers shared by the test suite, the self-check and the benchmarks.

The tolerance table lives here and nowhere else. Comparisons are always against the
float64 reference: a fast path computes in ``dtype`` (with fp32 statistics), the
reference in float64, and the difference must stay within ``TOLERANCES[dtype]``.
"""
from __future__ import annotations

import contextlib
import math
from typing import Dict, Tuple

import torch

from . import _alloc

# (atol, rtol) against a float64 reference, per input/output dtype. bf16 has 8 bits of
# mantissa (2**-8 = 0.0039 relative), fp16 11 bits; one rounding of the output plus
# a few of the intermediates is what these allow.
TOLERANCES: Dict[torch.dtype, Tuple[float, float]] = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 1.6e-2),
    torch.float16: (2e-3, 2e-3),
}

# Ops that accumulate over long reductions (GDN chunks, matmuls) get a per-op scale.
OP_SCALE: Dict[str, float] = {}


def tolerance(dtype: torch.dtype, op: str = "") -> Tuple[float, float]:
    atol, rtol = TOLERANCES[dtype]
    s = OP_SCALE.get(op, 1.0)
    return atol * s, rtol * s


def reduction_scale(length: int) -> float:
    """``scale`` (see :func:`assert_close`) for a quantity that sums ``length`` products in low
    precision (weight gradients over rows, dot products): partial sums grow with the square root
    of the length."""
    return math.sqrt(max(length, 1)) / 4 + 1


def rms_atol_scale(expected: torch.Tensor, factor: float = 2.0) -> float:
    """``atol_scale`` (see :func:`assert_close`) for a tensor of long reductions whose rounding
    error follows its typical entry: ``factor`` times its rms, at least ``factor``."""
    return factor * max(1.0, float(expected.double().pow(2).mean().sqrt()))


def max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    if actual.numel() == 0:
        return 0.0
    return (actual.double() - expected.double()).abs().max().item()


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype = None, *, op: str = "",
                 name: str = "output", scale: float = 1.0, atol_scale: float = 1.0) -> None:
    """Compare ``actual`` (computed in ``dtype``) with a float64 ``expected``.

    ``scale`` widens the tolerance for quantities that are sums over many terms
    (weight gradients summed over rows): pass the reduction length's square root.
    ``atol_scale`` widens the absolute tolerance only, for a tensor whose entries are far
    from unit size: the table's atol is for O(1) entries, and an entry that is a dot product
    of long vectors has a rounding error proportional to the typical entry (its rms), also
    where it cancels to almost 0 and ``rtol`` gives no room.
    NaN anywhere in ``actual`` fails (poisoned outputs that were never written).
    """
    dtype = dtype or actual.dtype
    atol, rtol = tolerance(dtype, op)
    atol, rtol = atol * scale * atol_scale, rtol * scale
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    if torch.isnan(actual).any() and not torch.isnan(expected).any():
        n = int(torch.isnan(actual).sum())
        raise AssertionError(f"{name}: {n} NaN elements (unwritten output?)")
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol,
                               msg=lambda m: f"{name} ({dtype}, atol={atol:g}, rtol={rtol:g}): {m}")


def poisoning() -> bool:
    """Whether outputs are being poisoned (inside :func:`poison_outputs`): code that leaves a
    buffer's old contents in place on the promise that nobody reads them may NaN-fill it then."""
    return _alloc.poisoning()


@contextlib.contextmanager
def poison_outputs(enabled: bool = True):
    """NaN-fill every output the fast paths allocate, inside the block."""
    prev = _alloc.set_poison(enabled)
    try:
        yield
    finally:
        _alloc.set_poison(prev)
