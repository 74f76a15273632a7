"""Unfused reference of the LM head and its loss: the whole [N, V] logits, then torch's cross entropy.

Readable and slow; the ground truth the fused paths are checked against (run it in float64).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def transformed_logits(hidden2d: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                       logit_softcap: Optional[float], temperature: float) -> torch.Tensor:
    """``z = softcap(x / temperature)`` with ``x = hidden @ weight.T + bias``, in fp32 (fp64 for fp64 inputs).

    The temperature divides the raw logits first; the softcap (Gemma's ``cap * tanh(z / cap)``)
    applies to the tempered logits.
    """
    cdt = torch.float64 if hidden2d.dtype == torch.float64 else torch.float32
    x = hidden2d.to(cdt) @ weight.to(cdt).T
    if bias is not None:
        x = x + bias.to(cdt)
    z = x / temperature
    if logit_softcap is not None:
        z = logit_softcap * torch.tanh(z / logit_softcap)
    return z


def fused_linear_cross_entropy_reference(hidden, weight, labels, bias=None, ignore_index=-100, reduction="mean",
                                         label_smoothing=0.0, logit_softcap=None, temperature=1.0,
                                         return_logps=False, return_entropy=False):
    """Same contract as :func:`twinkle_kernels.fused_linear_cross_entropy` (arguments already checked).

    The loss is ``F.cross_entropy`` itself (so ``mean`` over no valid label is NaN, as in torch);
    logps and entropy are 0 on ignored rows.
    """
    H = hidden.shape[-1]
    z = transformed_logits(hidden.reshape(-1, H), weight, bias, logit_softcap, temperature)
    y = labels.reshape(-1)
    loss = F.cross_entropy(z, y, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)
    if reduction == "none":
        loss = loss.view(labels.shape)
    if not (return_logps or return_entropy):
        return loss
    out = [loss]
    valid = y != ignore_index
    logp = torch.log_softmax(z, dim=-1)
    if return_logps:
        picked = logp.gather(1, torch.where(valid, y, 0).unsqueeze(1)).squeeze(1)
        out.append(torch.where(valid, picked, torch.zeros_like(picked)).view(labels.shape))
    if return_entropy:
        ent = -(logp.exp() * logp).sum(-1)
        out.append(torch.where(valid, ent, torch.zeros_like(ent)).view(labels.shape))
    return tuple(out)
