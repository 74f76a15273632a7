"""Output allocation for the fast paths.

Fast backends never allocate outputs themselves: they write into tensors made here.
When poisoning is on (tests turn it on with :func:`twinkle_kernels.testing.poison_outputs`),
fresh outputs are NaN-filled, so an element a kernel forgets to write fails the comparison
with the reference instead of passing by luck.
"""
from __future__ import annotations

import torch

_poison = False


def set_poison(enabled: bool) -> bool:
    """Turn NaN-filling of fresh outputs on or off; returns the previous setting."""
    global _poison
    prev, _poison = _poison, bool(enabled)
    return prev


def _fill(t: torch.Tensor) -> torch.Tensor:
    if _poison and t.numel():
        t.fill_(float("nan") if t.is_floating_point() else -1)
    return t


def empty(*shape, dtype, device) -> torch.Tensor:
    return _fill(torch.empty(*shape, dtype=dtype, device=device))


def empty_like(t: torch.Tensor, dtype=None) -> torch.Tensor:
    return _fill(torch.empty(t.shape, dtype=dtype or t.dtype, device=t.device))
