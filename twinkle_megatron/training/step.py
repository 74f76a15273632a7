"""The optimizer step: grads finalised once per step, clipped, stepped, zeroed.

Every function takes the :class:`.engine.Engine` and the :class:`.engine.TrainState` stepped (an
adapter's, or the base model's): its optimizer, grad buffers, pending loss count and
accumulation counter. The facade's ``clip_grad_norm``, ``step``, ``zero_grad`` and
``clip_grad_and_step`` are these, for the state of the adapter named.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..parallel import cpu_compat
from . import fused_adam, optim
from .engine import Engine, TrainState


class NonFiniteGradientError(RuntimeError):
    """The step was refused because the gradients (or their norm) are not finite. The grads were
    zeroed and nothing was stepped: training can go on with the next batch.

    Raised by a ``clip_grad_and_step`` over several adapters, ``failed`` names the adapters whose
    grads were not finite (each zeroed, not stepped) and ``results`` holds the grad norms (or None
    while accumulating) of the others, which stepped: one tenant's bad batch does not hold back
    the rest."""

    def __init__(self, message: str, failed=(), results=None):
        super().__init__(message)
        self.failed = tuple(failed)
        self.results = dict(results or {})


def missing_optimizer(name: Optional[str], what: str) -> str:
    """The error message of ``what`` run for adapter ``name`` (None: the base model) before its
    ``set_optimizer``."""
    if name is None:
        return f"call set_optimizer before {what}"
    return (f"adapter_name={name!r} has no optimizer: call set_optimizer(..., adapter_name={name!r}) "
            f"before {what}")


def require_optimizer(state: TrainState):
    if state.optimizer is None:
        raise RuntimeError(missing_optimizer(state.name, "this call"))
    return state.optimizer


def finalize_grads(engine: Engine, state: TrainState) -> None:
    """DP/SP/embedding grad reductions and the 1 / count scaling over every forward_backward of
    ``state`` since its last step (megatron's ``finalize_model_grads``, once per step). Grads
    the last step left stale, with no backward since, are zeroed first (``parallel/main_grads.py``)."""
    engine.settle_grads([state])
    if state.pending_tokens is not None:
        engine.finalize_model_grads(engine.wrapped(state), num_tokens=state.pending_tokens)
        state.pending_tokens = None


def clip_grad_norm(engine: Engine, state: TrainState, max_grad_norm: Optional[float]) -> float:
    """Total grad norm before clipping (over all model-parallel ranks); clips in place to
    ``max_grad_norm`` (0 or None: no clipping). fp16 with an overflowed loss scale: marks the step
    skipped and returns inf."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
    opt = require_optimizer(state)
    finalize_grads(engine, state)
    if not state.grads_ready:
        if opt.prepare_grads():
            if engine.dtype == torch.float16:
                # fp16: the dynamic loss scale overflowed (megatron's scaler has backed off);
                # clip_grad_and_step skips this step, as megatron's training loop does.
                state.skip_step = True
                return float("inf")
            raise NonFiniteGradientError("non-finite gradients: the step cannot be taken")
        state.grads_ready = True
    norm = float(opt.get_grad_norm())
    if not math.isfinite(norm):
        raise NonFiniteGradientError(f"grad norm is {norm}: the step cannot be taken")
    if max_grad_norm and max_grad_norm > 0:
        for o in optim.megatron_optimizers(opt):
            params = o.get_parameters()
            if params:
                clip_grad_by_total_norm_fp32(params, max_grad_norm, norm,
                                             o.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
    return norm


def step(engine: Engine, state: TrainState) -> None:
    """Optimizer step with the current (possibly clipped) grads."""
    opt = require_optimizer(state)
    finalize_grads(engine, state)
    if not state.grads_ready:
        if opt.prepare_grads():
            raise NonFiniteGradientError("non-finite gradients: the step cannot be taken")
    state.grads_ready = False
    if not opt.step_with_ready_grads():
        raise RuntimeError("optimizer step failed")
    state.cur_step += 1


def zero_grad(engine: Engine, state: TrainState, already_zero=()) -> None:
    """megatron's ``zero_grad_buffer`` of ``state``'s wrap (less the memset of ``already_zero``,
    buffers a one-pass step zeroed) and its optimizer's ``zero_grad``."""
    with fused_adam.skip_zeroing(already_zero):
        for m in engine.wrapped(state):
            m.zero_grad_buffer()
    require_optimizer(state).zero_grad()
    state.grads_ready = False
    state.pending_tokens = None


def _fused_clip_and_step(engine: Engine, state: TrainState, max_grad_norm):
    """:func:`clip_grad_norm` then :func:`step` in one pass over each parameter
    (:mod:`.fused_adam`): the grads stay unscaled in their buffers, and the 1 / tokens factor and
    the clipping coefficient go into the AdamW update, which zeroes each grad once read. Returns
    the pre-clip norm, as :func:`clip_grad_norm` (the clipping coefficient is megatron's), and the
    grad buffers the step left zero or stale (:func:`zero_grad` need not zero them again)."""
    opt = state.optimizer
    engine.settle_grads([state])
    factor = fused_adam.finalize_unscaled(engine, state)
    if not state.grads_ready:
        if opt.prepare_grads():   # no loss scaler here: megatron reports nothing to skip
            raise NonFiniteGradientError("non-finite gradients: the step cannot be taken")
        state.grads_ready = True
    norm = float(opt.get_grad_norm()) * factor
    if not math.isfinite(norm):
        raise NonFiniteGradientError(f"grad norm is {norm}: the step cannot be taken")
    clip = 1.0
    if max_grad_norm and max_grad_norm > 0:
        coeff = max_grad_norm / (norm + 1.0e-6)   # megatron's clip_grad_by_total_norm_fp32
        if coeff < 1.0:
            clip = coeff
    plan = fused_adam.collect(state, stale_ok=not engine.overlap.overlap_grad_reduce
                              and cpu_compat.claims_stale_main_grads())
    fused_adam.step(plan, factor * clip)
    state.grads_ready = False
    state.cur_step += 1
    return norm, plan.covered_buffers


def clip_grad_and_step(engine: Engine, state: TrainState, max_grad_norm,
                       gradient_accumulation_steps: int) -> Optional[float]:
    """One ``clip_grad_and_step`` call of ``state``: counts it towards
    ``gradient_accumulation_steps`` (a positive int; None is returned while accumulating), then
    clips, steps the optimizer and the LR scheduler and zeroes the grads; returns the pre-clip
    grad norm. Non-finite grads: zeroed, nothing stepped, :class:`NonFiniteGradientError`."""
    k = gradient_accumulation_steps
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"gradient_accumulation_steps must be a positive int, got {k!r}")
    require_optimizer(state)    # refused before anything is counted
    state.accumulated_calls += 1
    if state.accumulated_calls < k:
        return None
    state.accumulated_calls = 0
    try:
        zeroed = ()
        if state.fused_step and fused_adam.eligible(state):
            norm, zeroed = _fused_clip_and_step(engine, state, max_grad_norm)
        else:
            norm = clip_grad_norm(engine, state, max_grad_norm)
            if state.skip_step:
                state.skip_step = False
                zero_grad(engine, state)
                state.metric.grad_norm = norm
                return norm
            step(engine, state)
    except NonFiniteGradientError:
        zero_grad(engine, state)
        raise
    if state.lr_scheduler is not None:
        state.lr_scheduler.step(increment=1)
    zero_grad(engine, state, zeroed)
    state.metric.grad_norm = norm
    return norm
