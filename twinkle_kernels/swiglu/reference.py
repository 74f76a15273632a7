"""Readable gated-linear-unit references: ``act(gate) * up``, act SiLU (SwiGLU) or GELU (GeGLU)."""
from __future__ import annotations

import torch

from .. import _activations


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """``act(gate) * up`` with fp32 math (float64 stays float64), output in gate's dtype.

    ``activation``: ``"silu"``, ``"gelu"`` (exact, erf) or ``"gelu_tanh"`` (tanh approximation).
    """
    _activations.check(activation)
    ct = torch.float64 if gate.dtype == torch.float64 else torch.float32
    return (_activations.apply(gate.to(ct), activation) * up.to(ct)).to(gate.dtype)


def swiglu_packed_reference(x: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """Megatron's packed layout: ``act(x[..., :n]) * x[..., n:]`` with ``n = x.shape[-1] // 2``."""
    gate, up = torch.chunk(x, 2, dim=-1)
    return swiglu_reference(gate, up, activation)
