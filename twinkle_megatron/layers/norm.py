"""RMSNorm modules for megatron-core layer specs: the local one (Hugging Face rounding order) and
the one on ``twinkle_kernels.rms_norm``, plus the gated output norm of the Gated DeltaNet.

Both modules take megatron's norm signature ``(config, hidden_size, eps)`` and mark their weight
``sequence_parallel`` when the config says so (megatron's own ``WrappedTorchNorm`` refuses
sequence parallelism).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

import twinkle_kernels as tk


class RMSNorm(torch.nn.Module):
    """RMSNorm with the Hugging Face rounding order, so megatron and transformers agree bit for bit.
    ``hidden_size``: the last dimension. Plain (Llama/Qwen3): normalise in fp32, cast, then scale by
    ``weight``. Zero-centred (Qwen3.5, ``config.layernorm_zero_centered_gamma`` unless
    ``zero_centered`` says otherwise): weight starts at 0, scale ``1 + weight`` applied in fp32."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, zero_centered: Optional[bool] = None):
        super().__init__()
        if zero_centered is None:
            zero_centered = bool(getattr(config, "layernorm_zero_centered_gamma", False))
        self.zero_centered = zero_centered
        init = torch.zeros if zero_centered else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype))
        self.eps = eps
        # With sequence parallelism each TP rank sees a slice of the tokens: megatron all-reduces
        # the grads of parameters marked this way across the TP group.
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered:
            return (h * (1.0 + self.weight.float())).to(dtype)
        return self.weight * h.to(dtype)


class TwinkleRMSNorm(RMSNorm):
    """RMSNorm over the last dim through ``tk.rms_norm``. Signature and parameters as
    :class:`RMSNorm`: ``(config, hidden_size, eps, zero_centered=None)``; with
    ``config.layernorm_zero_centered_gamma`` (or ``zero_centered=True``) the weight starts at 0 and
    the scale is ``1 + weight`` (Qwen3.5 / Qwen3-Next)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tk.rms_norm(x, self.weight, self.eps, offset=1.0 if self.zero_centered else 0.0)

    def gated(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``rms_norm(x) * silu(gate)`` in one ``tk.gated_rms_norm`` call (Qwen3.5's
        ``RMSNormGated``): ``x`` and ``gate`` [..., hidden_size], result in ``x.dtype``. Only for a
        plain-weight norm (the gated kernel scales by ``weight``, not ``1 + weight``)."""
        if self.zero_centered:
            raise ValueError("TwinkleRMSNorm.gated needs a plain-weight norm (zero_centered=False)")
        return tk.gated_rms_norm(x, gate.to(x.dtype), self.weight.to(x.dtype), self.eps)


def gated_norm(norm: torch.nn.Module, x: torch.Tensor, gate: torch.Tensor,
               act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``norm(x) * act(gate)`` over the rows of ``x`` / ``gate`` [..., V] (flattened to [N, V]),
    the gate in fp32, result [N, V] in ``x.dtype``: megatron's ``GatedDeltaNet._apply_gated_norm``
    without its torch.compile wrapper."""
    y = norm(x.reshape(-1, x.shape[-1]))
    return (y * act(gate.reshape(-1, gate.shape[-1]).float())).to(x.dtype)
