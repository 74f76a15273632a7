"""The CPU optimizer step of ``clip_grad_and_step`` in one pass over each parameter.

megatron's mixed-precision step makes separate passes over the fp32 grads and weights: the
finalisation scales every grad by 1 / tokens, the clip scales it again, torch's AdamW steps the
fp32 master weights, and the new weights are copied into the model's bf16 parameters. On a CPU
every pass is bound by memory, and at a published width those passes cost more than the
model's own backward (the phase tables of ``benchmarks/scripts/train_step.py``).

Here the finalisation runs megatron's reductions but hands back its 1 / tokens factor instead of
applying it (:func:`finalize_unscaled`); the grad norm is megatron's own, of the unscaled grads,
times that factor (a norm is linear in its scale); and the scale, the clipping coefficient, the
AdamW update and the copy to bf16 are one :func:`twinkle_kernels.adamw_step` pass per tensor
(:func:`step`). The update is torch's AdamW on the same fp32 grads up to their rounding
(``g * (s * c)`` once instead of ``g * s`` then ``* c``); the optimizer's state (moments and step
counts) is torch's own, so checkpoints and ``state_dict`` are unchanged.

Only ``clip_grad_and_step`` takes this path: nothing runs between its norm and its step, so
nobody reads the unscaled grads (a separate ``clip_grad_norm`` leaves them scaled and clipped, as
before). :func:`eligible` says when it applies; anything else steps through megatron as before.
"""
from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, List, Tuple

import torch

from . import optim

if TYPE_CHECKING:   # annotations only: engine imports metrics, which names this module's path
    from .engine import Engine, TrainState


class Plan:
    """What one fused step updates: per torch optimizer, its param groups' tensors; and the DDP
    grad buffers whose every gradient the step reads (and zeroes, or marks stale)."""

    def __init__(self, groups: List[Tuple[dict, list, list, list]], covered_buffers: list, stale_ok: bool = False):
        # (param group, [fp32 params with a grad], [their bf16 / fp16 model params, or None],
        #  [their torch optimizer state dicts])
        self.groups = groups
        # main grads are contiguous views into the buffers; a non-contiguous grad (not one of
        # them) is read through a copy, so nothing is zeroed in place then
        self.zero_grads = all(p.grad.is_contiguous() for _, params, _, _ in groups for p in params)
        self.covered_buffers = covered_buffers if self.zero_grads else []
        # stale instead of zeroed (parallel/main_grads.py) where every grad read is its model
        # parameter's main_grad itself, the tensor the writers claim
        self.stale = stale_ok and self.zero_grads and all(
            getattr(m if m is not None else p, "main_grad", None) is p.grad
            for _, params, models, _ in groups for p, m in zip(params, models))


def eligible(state: TrainState) -> bool:
    """Whether ``state``'s optimizer steps through :func:`step`; False where megatron steps as
    before: parameters not all float32 on the CPU, the C++ kernel not built, fp16 (a loss
    scaler), the distributed optimizer or another optimizer class than megatron's
    ``Float16OptimizerWithFloat16Params`` / ``FP32Optimizer``, an inner optimizer other than
    torch's AdamW (or Adam without weight decay), amsgrad / maximize / capturable /
    differentiable, or a step count torch keeps elsewhere than in a float32 CPU tensor."""
    opt = state.optimizer
    if opt is None or not _kernel_available():
        return False
    chained = getattr(opt, "chained_optimizers", None)
    if chained is not None and getattr(opt.config, "overlap_param_gather_with_optimizer_step", False):
        return False
    return all(_eligible(o) for o in optim.megatron_optimizers(opt))


def _eligible(o) -> bool:
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer
    if type(o) not in (Float16OptimizerWithFloat16Params, FP32Optimizer):
        return False
    if getattr(o, "is_stub_optimizer", False):
        return True
    if getattr(o, "grad_scaler", None) is not None or getattr(o.config, "reuse_grad_buf_for_mxfp8_param_ag", False):
        return False
    inner = o.optimizer
    if type(inner) not in (torch.optim.AdamW, torch.optim.Adam):
        return False
    for model_group in getattr(o, "float16_groups", ()):
        if any(not m.is_contiguous() or m.device.type != "cpu" for m in model_group):
            return False   # written in place by the kernel
    for group in inner.param_groups:
        if any(group.get(k) for k in ("amsgrad", "maximize", "capturable", "differentiable")):
            return False
        decoupled = type(inner) is torch.optim.AdamW or group.get("decoupled_weight_decay", False)
        if not decoupled and float(group["weight_decay"]) != 0.0:
            return False   # Adam's L2 decay goes into the grad: not this update
        for p in group["params"]:
            if p.device.type != "cpu" or p.dtype != torch.float32 or not p.is_contiguous():
                return False
            st = inner.state.get(p)
            if st and not (_cpu_step_count(st.get("step")) and "exp_avg" in st and "exp_avg_sq" in st):
                return False
    return True


def collect(state: TrainState, stale_ok: bool = False) -> Plan:
    """The tensors of the fused step of an :func:`eligible` ``state``, after megatron's
    ``prepare_grads`` (which points each fp32 param's ``.grad`` at its ``main_grad``): the params
    with a grad (torch skips the others, their step counts too), their model copies and their
    AdamW state, made as torch makes it on a param's first step (zero moments, step 0).
    ``stale_ok``: the grads may be left stale instead of zeroed (every writer of them claims,
    ``parallel/main_grads.py``; no reduction runs during the backward)."""
    opt = state.optimizer
    groups = []
    for o in optim.megatron_optimizers(opt):
        if getattr(o, "is_stub_optimizer", False):
            continue
        inner = o.optimizer
        model_of = {}
        for model_group, main_group in zip(getattr(o, "float16_groups", ()), getattr(o, "fp32_from_float16_groups", ())):
            for model_param, main_param in zip(model_group, main_group):
                model_of[id(main_param)] = model_param
        for group in inner.param_groups:
            params, models, states = [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = inner.state[p]
                if not st:
                    st["step"] = torch.zeros((), dtype=torch.float32)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                params.append(p)
                models.append(model_of.get(id(p)))
                states.append(st)
            groups.append((group, params, models, states))
    return Plan(groups, _covered_buffers(state, groups), stale_ok)


def _covered_buffers(state: TrainState, groups) -> list:
    """The DDP grad buffers of ``state``'s wrap all of whose parameters' ``main_grad`` is a grad
    the step reads: zeroed by the step, or left stale (``parallel/main_grads.py``: zero by the
    mark), each is zero afterwards (its padding is never written), so :func:`skip_zeroing` may
    leave out megatron's memset. A buffer with megatron's
    extra main grads (0.19), or one a grad of the step does not cover, is zeroed as before."""
    read = {(p.grad.data_ptr(), p.grad.numel()) for _, params, _, _ in groups for p in params}
    covered = []
    for m in state.model or ():
        for b in list(getattr(m, "buffers", ())) + list(getattr(m, "expert_parallel_buffers", ())):
            if getattr(b, "extra_main_grads", None) or not getattr(b, "params", None):
                continue
            grads = [getattr(p, "main_grad", None) for p in b.params]
            if all(g is not None and (g.data_ptr(), g.numel()) in read for g in grads):
                covered.append(b)
    return covered


@contextlib.contextmanager
def skip_zeroing(buffers):
    """Within the block, megatron's ``zero_grad_buffer`` leaves ``buffers`` as they are (its
    per-buffer ``reset`` is the memset of ``grad_data``; the bucket groups' bookkeeping and
    ``grad_added_to_main_grad`` are still reset). For buffers :func:`step` zeroed."""
    for b in buffers:
        b.reset = _already_zero
    try:
        yield
    finally:
        for b in buffers:
            del b.reset


def _already_zero():
    pass


def _cpu_step_count(step) -> bool:
    return (isinstance(step, torch.Tensor) and step.dtype == torch.float32 and step.numel() == 1
            and step.device.type == "cpu")


@functools.lru_cache(maxsize=None)
def _kernel_available() -> bool:
    """Whether the C++ backend serves ``adamw_step`` in this process (a build that predates the
    op does not: the reference would be slower than megatron's own step)."""
    import twinkle_kernels as tk
    if tk.backend_status("cpu") is not None:
        return False
    one = [torch.zeros(1)]
    try:
        tk.adamw_step(one, [torch.zeros(1)], [torch.zeros(1)], [torch.zeros(1)], [torch.zeros(())],
                      lr=0.0, backend="cpu")
    except tk.BackendUnavailableError:
        return False
    return True


def finalize_unscaled(engine: Engine, state: TrainState) -> float:
    """megatron's ``finalize_model_grads`` over ``state``'s wrap (its DP / SP / embedding
    reductions) without its 1 / tokens scaling of the grad buffers: the factor it would have
    applied is returned instead (1.0 when nothing is pending). megatron computes the factor (the
    token count broadcast over the pipeline and summed over DP); only the wrap's
    ``scale_gradients`` is replaced, for the duration of the call."""
    if state.pending_tokens is None:
        return 1.0
    chunks = engine.wrapped(state)
    factors = []
    shadowed = [m for m in chunks if "scale_gradients" in vars(m)]
    if shadowed:
        raise RuntimeError("finalize_unscaled: a model chunk's scale_gradients is already replaced")
    for m in chunks:
        m.scale_gradients = lambda factor: factors.append(float(factor))
    try:
        engine.finalize_model_grads(chunks, num_tokens=state.pending_tokens)
    finally:
        for m in chunks:
            del m.scale_gradients
    state.pending_tokens = None
    if not factors:   # megatron (<= 0.18) skips the scaling for a zero token count
        return 1.0
    if any(f != factors[0] for f in factors):
        raise RuntimeError(f"finalize_unscaled: megatron scaled its chunks by different factors {factors}")
    return factors[0]


def step(fused: Plan, grad_factor: float) -> None:
    """The AdamW update of every tensor of ``fused`` from its grad times ``grad_factor``, each
    new fp32 weight copied into its bf16 / fp16 model parameter in the same pass, and each grad
    zeroed once read (``clip_grad_and_step`` zeroes them next: nothing reads them in between), or
    with ``fused.stale`` left as it is and marked stale (the next backward's first write
    overwrites it)."""
    import twinkle_kernels as tk
    from ..parallel import main_grads
    for group, params, models, states in fused.groups:
        with_copy = [i for i, m in enumerate(models) if m is not None]
        without = [i for i, m in enumerate(models) if m is None]
        hyper = dict(lr=float(group["lr"]), betas=tuple(float(b) for b in group["betas"]),
                     eps=float(group["eps"]), weight_decay=float(group["weight_decay"]), grad_factor=grad_factor)
        for idx, out in ((with_copy, True), (without, False)):
            if not idx:
                continue
            ps = [params[i] for i in idx]
            sts = [states[i] for i in idx]
            tk.adamw_step(ps, [p.grad for p in ps], [s["exp_avg"] for s in sts], [s["exp_avg_sq"] for s in sts],
                          [s["step"] for s in sts], out_params=[models[i].data for i in idx] if out else None,
                          zero_grads=fused.zero_grads and not fused.stale, backend="cpu", **hyper)
    if fused.stale:
        main_grads.mark([p.grad for _, params, _, _ in fused.groups for p in params])

