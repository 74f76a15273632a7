"""Verifier pieces every op's backends share (see :mod:`._dispatch`: a verifier returns None when
its backend can serve a call, else the reason, which the registry logs once).

Each op's ``__init__`` composes these on the tensor that decides the device and dtype of a call
(``x``, ``q``, ``gate``, ...) and adds its own shape limits.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ._backends import triton_interpret
from ._dtypes import FAST_DTYPES
from .npu import ops as _npu_ops

FORWARD_ONLY = "the fused recurrent form is forward only; gradients are served by the reference"


def dtype_reason(t: torch.Tensor) -> Optional[str]:
    """The fast backends serve :data:`~._dtypes.FAST_DTYPES`; the reference serves the rest."""
    if t.dtype not in FAST_DTYPES:
        return f"dtype {t.dtype} is served by the reference only"
    return None


def cpu_reason(t: torch.Tensor) -> Optional[str]:
    """The cpu backend: CPU tensors of a fast dtype."""
    if t.device.type != "cpu":
        return f"the cpu backend needs CPU tensors (got {t.device.type})"
    return dtype_reason(t)


def triton_device_reason(*tensors: torch.Tensor) -> Optional[str]:
    """The triton backend's device rule: CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``."""
    dev = tensors[0].device
    if dev.type == "cuda":
        return None
    if dev.type == "cpu" and triton_interpret():
        return None
    return f"triton needs CUDA tensors (got {dev.type}; CPU tensors only with TRITON_INTERPRET=1)"


def triton_reason(t: torch.Tensor) -> Optional[str]:
    """The triton backend: its device rule, and a fast dtype."""
    return triton_device_reason(t) or dtype_reason(t)


def npu_reason(t: torch.Tensor) -> Optional[str]:
    """The npu backend: NPU tensors torch_npu's kernels take (see :mod:`.npu.ops`)."""
    return _npu_ops.tensor_reason(t)


def by_first(reason: Callable[[torch.Tensor], Optional[str]]) -> Callable[..., Optional[str]]:
    """A verifier that judges the call by its first argument: ``reason(t)`` for ``(t, *rest)``."""
    return lambda t, *rest: reason(t)


def needs_grad(*tensors) -> bool:
    """Whether this call will be differentiated through any of ``tensors`` (None entries allowed)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
