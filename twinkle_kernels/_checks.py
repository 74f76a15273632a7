"""Argument checks shared by the public ops. Every error names the argument."""
from __future__ import annotations

from typing import Optional, Sequence

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
