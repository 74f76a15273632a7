"""Argument checks shared by the public ops. Every error names the argument."""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def tensor(name: str, t, *, float_only: bool = True, ndim_min: int = 0) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if float_only and t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating tensor (float32, bfloat16, float16 or float64), got {t.dtype}")
    if t.dim() < ndim_min:
        raise ValueError(f"{name} must have at least {ndim_min} dims, got shape {tuple(t.shape)}")


def same_device(names: Sequence[str], tensors: Sequence[Optional[torch.Tensor]]) -> None:
    pairs = [(n, t) for n, t in zip(names, tensors) if t is not None]
    n0, t0 = pairs[0]
    for n, t in pairs[1:]:
        if t.device != t0.device:
            raise ValueError(f"{n} is on {t.device} but {n0} is on {t0.device}; all inputs must share a device")


def same_dtype(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
    n0, t0 = names[0], tensors[0]
    for n, t in zip(names[1:], tensors[1:]):
        if t.dtype != t0.dtype:
            raise TypeError(f"{n} has dtype {t.dtype} but {n0} has {t0.dtype}; they must match")


def same_shape(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
    n0, t0 = names[0], tensors[0]
    for n, t in zip(names[1:], tensors[1:]):
        if t.shape != t0.shape:
            raise ValueError(f"{n} has shape {tuple(t.shape)} but {n0} has {tuple(t0.shape)}; they must match")


def positive_float(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(v).__name__}")
    v = float(v)
    if not v > 0.0 or v != v or v == float("inf"):
        raise ValueError(f"{name} must be a positive finite number, got {v}")
    return v


def finite_float(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(v).__name__}")
    v = float(v)
    if v != v or v in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be finite, got {v}")
    return v


def nonneg_float(name: str, v) -> float:
    """``v`` as a float, refused unless it is a finite number >= 0."""
    v = finite_float(name, v)
    if v < 0:
        raise ValueError(f"{name} must be >= 0, got {v}")
    return v


def cu_seqlens(cu, batch: int, total: int, device, values: bool = True) -> Optional[List[int]]:
    """Validates packed-sequence offsets; returns them as a list (None when not packed).

    ``values=False`` checks type, dtype, shape and device only and returns None: under
    torch.compile reading the offsets would break the graph, so the op checks them when it runs."""
    if cu is None:
        return None
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor of int32/int64, got {type(cu).__name__}")
    if cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must be an integer tensor (int32 or int64), got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries (N + 1 offsets), got shape {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"cu_seqlens is on {cu.device} but the inputs are on {device}; all inputs must share a device")
    if batch != 1:
        raise ValueError(f"cu_seqlens needs packed inputs with batch size 1, got B={batch}")
    if not values:
        return None
    vals = [int(c) for c in cu.tolist()]
    if vals[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {vals[0]}")
    if any(b < a for a, b in zip(vals, vals[1:])):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {vals}")
    if vals[-1] != total:
        raise ValueError(f"cu_seqlens must end at the sequence length T={total}, got {vals[-1]}")
    return vals
