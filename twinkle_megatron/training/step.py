"""The optimizer step of the facade: grads finalised once per step, clipped, stepped, zeroed.

Every function takes the facade (``MegatronModel``) and works on the state of the adapter whose
call is running (its optimizer, grad buffers, pending token count and accumulation counter; see
``MegatronModel._using``). The public methods of the facade (``clip_grad_norm``, ``step``,
``zero_grad``, ``clip_grad_and_step``) are these.
"""
from __future__ import annotations

import math
from typing import Optional

import torch


class NonFiniteGradientError(RuntimeError):
    """The step was refused because the gradients (or their norm) are not finite. The grads were
    zeroed and nothing was stepped: training can go on with the next batch."""


def defer_finalize(model, num_tokens=None) -> None:
    """megatron's ``finalize_model_grads_func`` hook: record the schedule call's loss tokens, so
    that the grads of several calls are reduced and scaled once, before the step."""
    tokens = torch.zeros([], dtype=torch.int, device=model.device) if num_tokens is None else num_tokens
    model._pending_tokens = tokens.clone() if model._pending_tokens is None else model._pending_tokens + tokens


def finalize_grads(model) -> None:
    """DP/SP/embedding grad reductions and the token-mean scaling over every forward_backward
    since the last step."""
    if model._pending_tokens is not None:
        model._finalize(model.model, num_tokens=model._pending_tokens)
        model._pending_tokens = None


def clip_grad_norm(model, max_grad_norm: Optional[float]) -> float:
    """Total grad norm before clipping (over all model-parallel ranks); clips in place to
    ``max_grad_norm`` (0 or None: no clipping). fp16 with an overflowed loss scale: marks the step
    skipped and returns inf."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
    opt = model._require_optimizer()
    finalize_grads(model)
    if not model._grads_ready:
        if opt.prepare_grads():
            if model.dtype == torch.float16:
                # fp16: the dynamic loss scale overflowed (megatron's scaler has backed off);
                # clip_grad_and_step skips this step, as megatron's training loop does.
                model._skip_step = True
                return float("inf")
            raise NonFiniteGradientError("non-finite gradients: the step cannot be taken")
        model._grads_ready = True
    norm = float(opt.get_grad_norm())
    if not math.isfinite(norm):
        raise NonFiniteGradientError(f"grad norm is {norm}: the step cannot be taken")
    if max_grad_norm and max_grad_norm > 0:
        for o in getattr(opt, "chained_optimizers", [opt]):
            params = o.get_parameters()
            if params:
                clip_grad_by_total_norm_fp32(params, max_grad_norm, norm,
                                             o.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
    return norm


def step(model) -> None:
    """Optimizer step with the current (possibly clipped) grads."""
    opt = model._require_optimizer()
    finalize_grads(model)
    if not model._grads_ready:
        if opt.prepare_grads():
            raise NonFiniteGradientError("non-finite gradients: the step cannot be taken")
    model._grads_ready = False
    if not opt.step_with_ready_grads():
        raise RuntimeError("optimizer step failed")
    model.cur_step += 1


def zero_grad(model) -> None:
    for m in model.model:
        m.zero_grad_buffer()
    model._require_optimizer().zero_grad()
    model._grads_ready = False
    model._pending_tokens = None


def clip_grad_and_step(model, max_grad_norm, gradient_accumulation_steps: int) -> Optional[float]:
    """One ``clip_grad_and_step`` call of the running adapter: counts it towards
    ``gradient_accumulation_steps`` (a positive int; None is returned while accumulating), then
    clips, steps the optimizer and the LR scheduler and zeroes the grads; returns the pre-clip
    grad norm. Non-finite grads: zeroed, nothing stepped, :class:`NonFiniteGradientError`."""
    k = gradient_accumulation_steps
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"gradient_accumulation_steps must be a positive int, got {k!r}")
    model.accumulated_calls += 1
    if model.accumulated_calls < k:
        return None
    model.accumulated_calls = 0
    try:
        norm = clip_grad_norm(model, max_grad_norm)
        if model._skip_step:
            model._skip_step = False
            zero_grad(model)
            model._metric.grad_norm = norm
            return norm
        step(model)
    except NonFiniteGradientError:
        zero_grad(model)
        raise
    if model.lr_scheduler is not None:
        model.lr_scheduler.step(increment=1)
    zero_grad(model)
    model._metric.grad_norm = norm
    return norm
