"""Readable SwiGLU references."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` with fp32 math, output in gate's dtype."""
    ct = torch.float64 if gate.dtype == torch.float64 else torch.float32
    return (F.silu(gate.to(ct)) * up.to(ct)).to(gate.dtype)


def swiglu_packed_reference(x: torch.Tensor) -> torch.Tensor:
    """Megatron's packed layout: ``silu(x[..., :n]) * x[..., n:]`` with ``n = x.shape[-1] // 2``."""
    gate, up = torch.chunk(x, 2, dim=-1)
    return swiglu_reference(gate, up)
