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


def poisoning() -> bool:
    """Whether fresh outputs are NaN-filled (the C++ autograd ops are told per call)."""
    return _poison


def _fill(t: torch.Tensor) -> torch.Tensor:
    if t.numel():
        t.fill_(float("nan") if t.is_floating_point() else -1)
    return t


# These run several times per op call, so they stay lean: at hidden sizes of a few hundred an
# op's Python-side cost is comparable to its kernel (``torch.empty_like`` is about half the cost
# of ``torch.empty(shape, dtype=, device=)`` on the 2-core CI machine).
def empty(*shape, dtype, device) -> torch.Tensor:
    t = torch.empty(*shape, dtype=dtype, device=device)
    return _fill(t) if _poison else t


def empty_like(t: torch.Tensor, dtype=None) -> torch.Tensor:
    """A fresh contiguous tensor of ``t``'s shape and device (``t``'s dtype unless given)."""
    out = torch.empty_like(t, dtype=dtype, memory_format=torch.contiguous_format)
    return _fill(out) if _poison else out


def empty_like_weight(w: torch.Tensor) -> torch.Tensor:
    """A fresh ``[E, K, N]`` tensor (the gradient of a grouped weight ``w``) in ``w``'s memory layout.

    For ``proj.transpose(1, 2)`` views of a contiguous ``[E, N, K]`` parameter the result is the
    same kind of view, so autograd hands the parameter a plain contiguous gradient, no copy."""
    e, k, n = w.shape
    if not w.is_contiguous() and w.transpose(1, 2).is_contiguous():
        return empty(e, n, k, dtype=w.dtype, device=w.device).transpose(1, 2)
    return empty(e, k, n, dtype=w.dtype, device=w.device)
