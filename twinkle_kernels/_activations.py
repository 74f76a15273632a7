"""The activations a gated linear unit may put on its gate: their names, their pure-torch form, and the
numbers the C++ and Triton kernels know them by. Core (no op package): the ``swiglu`` ops and the
``moe_experts`` op take the same ``activation=``.

- ``"silu"``: ``g * sigmoid(g)`` (SwiGLU; Llama, Qwen, Mixtral, DeepSeek);
- ``"gelu"``: exact GELU, ``g * Phi(g)`` with the normal CDF ``Phi`` (GeGLU; transformers'
  ``"gelu"``, ``torch.nn.functional.gelu``);
- ``"gelu_tanh"``: GELU's tanh approximation,
  ``0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))`` (transformers' ``"gelu_pytorch_tanh"`` and
  ``"gelu_new"``, ``F.gelu(approximate="tanh")``; Gemma).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
# the ``act`` argument of the C++ ops and the ``ACT`` constexpr of the Triton kernels
CODE = {name: i for i, name in enumerate(ACTIVATIONS)}


def check(activation, name: str = "activation") -> str:
    """``activation`` if it names one of :data:`ACTIVATIONS`, else a TypeError / ValueError naming ``name``."""
    if not isinstance(activation, str):
        raise TypeError(f"{name} must be a str, one of {ACTIVATIONS}, got {type(activation).__name__}")
    if activation not in CODE:
        raise ValueError(f"{name}={activation!r} is not supported; expected one of {ACTIVATIONS}")
    return activation


def apply(gate: torch.Tensor, activation: str) -> torch.Tensor:
    """``activation(gate)`` in gate's dtype (pure torch; differentiable)."""
    if activation == "silu":
        return F.silu(gate)
    if activation == "gelu":
        return F.gelu(gate)
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh")
    raise ValueError(f"activation={activation!r} is not supported; expected one of {ACTIVATIONS}")
