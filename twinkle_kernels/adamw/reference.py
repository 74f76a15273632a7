"""The reference of :func:`twinkle_kernels.adamw_step`: torch's own single-tensor AdamW update, one
tensor at a time, with the gradient scaled first."""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch


@torch.no_grad()
def adamw_step_reference(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                         exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor],
                         steps: Sequence[torch.Tensor], out_params: Optional[Sequence[torch.Tensor]], *,
                         lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                         grad_factor: float, zero_grads: bool = False) -> None:
    """In place, as :func:`twinkle_kernels.adamw_step` documents; the update of
    ``torch.optim.AdamW`` (``foreach=False``) on ``grad * grad_factor``."""
    for k, p in enumerate(params):
        steps[k] += 1
        t = float(steps[k])
        g = grads[k].to(torch.float32) * grad_factor
        p.mul_(1 - lr * weight_decay)
        exp_avgs[k].lerp_(g, 1 - beta1)
        exp_avg_sqs[k].mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (exp_avg_sqs[k].sqrt() / math.sqrt(1 - beta2 ** t)).add_(eps)
        p.addcdiv_(exp_avgs[k], denom, value=-lr / (1 - beta1 ** t))
        if out_params is not None:
            out_params[k].copy_(p)
        if zero_grads:
            grads[k].zero_()
