"""The learning-rate schedule of :meth:`MegatronModel.set_lr_scheduler`: the guide's scheduler
names and keyword spellings mapped onto megatron's ``OptimizerParamScheduler``."""
from __future__ import annotations

import math
import numbers
from typing import Optional

# scheduler name -> megatron lr_decay_style; "default" is megatron's OptimizerParamScheduler
# with cosine decay (the torch names map to the same schedule shapes, stepped per optimizer step)
_SCHEDULERS = {"cosinewarmupscheduler": "cosine", "cosine": "cosine", "cosineannealinglr": "cosine",
               "default": "cosine", "optimizerparamscheduler": "cosine",
               "linearwarmupscheduler": "linear", "linear": "linear", "linearlr": "linear",
               "constantscheduler": "constant", "constant": "constant"}


def lr_scheduler(optimizer, opt_config, scheduler_cls: str = "CosineWarmupScheduler", *,
                 num_warmup_steps: Optional[int] = None, num_training_steps: Optional[int] = None,
                 min_lr: Optional[float] = None, lr_warmup_steps: Optional[int] = None,
                 lr_decay_steps: Optional[int] = None, max_lr: Optional[float] = None, **kwargs):
    """megatron's ``OptimizerParamScheduler`` for ``optimizer`` (built from ``opt_config``, whose
    ``lr`` ``max_lr`` replaces); arguments as :meth:`MegatronModel.set_lr_scheduler`."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    style = _SCHEDULERS.get(str(scheduler_cls).lower())
    if style is None:
        raise ValueError(f"scheduler_cls={scheduler_cls!r} is not supported: {sorted(_SCHEDULERS)}")
    warmup = _one_of("warmup steps", num_warmup_steps=num_warmup_steps, lr_warmup_steps=lr_warmup_steps)
    total = _one_of("decay steps", num_training_steps=num_training_steps, lr_decay_steps=lr_decay_steps,
                    T_max=kwargs.pop("T_max", None), total_iters=kwargs.pop("total_iters", None))
    min_lr = _one_of("min_lr", min_lr=min_lr, eta_min=kwargs.pop("eta_min", None))
    if kwargs:
        raise TypeError(f"set_lr_scheduler: unknown argument(s) {sorted(kwargs)}")
    _check_steps(num_warmup_steps=num_warmup_steps, lr_warmup_steps=lr_warmup_steps,
                 num_training_steps=num_training_steps, lr_decay_steps=lr_decay_steps, decay_steps=total)
    _check_lr(min_lr=min_lr, max_lr=max_lr)
    warmup, min_lr = warmup or 0, min_lr or 0.0
    total = total if total is not None else warmup + 1
    if total <= warmup:   # megatron's scheduler needs a decay phase after the warmup
        raise ValueError(f"num_training_steps={total} must be > num_warmup_steps={warmup}")
    if max_lr is not None:
        opt_config.lr = float(max_lr)
    wd = opt_config.weight_decay
    # megatron's scheduler prefers a param group's own 'min_lr'/'max_lr' (set from
    # OptimizerConfig) over its arguments: without this the schedule would ignore them.
    for group in optimizer.param_groups:
        if "min_lr" in group:
            group["min_lr"] = min_lr
        if "max_lr" in group:
            group["max_lr"] = opt_config.lr
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=opt_config.lr, min_lr=min_lr,
        lr_warmup_steps=warmup, lr_decay_steps=total,
        lr_decay_style=style, start_wd=wd, end_wd=wd, wd_incr_steps=total,
        wd_incr_style="constant")


def _one_of(what, **spellings):
    given = {k: v for k, v in spellings.items() if v is not None}
    if len(given) > 1:
        raise TypeError(f"{what}: give one of {sorted(given)}, not several")
    return next(iter(given.values()), None)


def _check_steps(**spellings) -> None:
    """Scheduler step counts: integers >= 0 (a bool, a float or a negative count is a mistake that
    megatron's scheduler would run with silently)."""
    for name, v in spellings.items():
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise TypeError(f"{name} must be an integer number of steps, got {v!r}")
        if v < 0:
            raise ValueError(f"{name} must be >= 0, got {v}")


def _check_lr(**values) -> None:
    for name, v in values.items():
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")


def check_max_grad_norm(max_grad_norm) -> None:
    """``max_grad_norm``: a finite number > 0, or None (no clipping). A negative, zero or NaN bar
    would make megatron's clip scale every gradient by a meaningless factor."""
    if max_grad_norm is None:
        return
    if (isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, numbers.Real)
            or not math.isfinite(max_grad_norm) or max_grad_norm <= 0):
        raise ValueError(f"max_grad_norm must be a finite number > 0 or None, got {max_grad_norm!r}")


def use_fused_adam(optimizer) -> int:
    """Switch the torch Adam/AdamW instances inside megatron's ``optimizer`` to torch's fused
    kernel; returns how many were switched.

    Without Transformer Engine or Apex, megatron-core builds ``torch.optim.AdamW`` (or ``Adam``)
    and leaves the implementation to torch, which picks the per-tensor loop on CPU: the
    optimizer then takes about a third of a bf16 training step. torch's fused kernel
    (CPU and CUDA) does the same update in one pass per tensor, 3x faster on CPU; it differs from
    the loop only in rounding (1 ulp of fp32). Optimizers whose parameters sit on a device
    without that kernel, or are not floating point, are left as built; TE's and Apex's fused
    Adams are not torch optimizers and are left alone too."""
    import torch
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    devices = set(_get_fused_kernels_supported_devices())
    switched = 0
    for inner in torch_optimizers(optimizer):
        if type(inner) not in (torch.optim.Adam, torch.optim.AdamW):
            continue
        params = [p for g in inner.param_groups for p in g["params"]]
        if not params or any(p.device.type not in devices or not p.is_floating_point() for p in params):
            continue
        if any(g.get("differentiable") or g.get("capturable") for g in inner.param_groups):
            continue
        inner.defaults.update(fused=True, foreach=False)
        for g in inner.param_groups:
            g.update(fused=True, foreach=False)
        switched += 1
    return switched


def megatron_optimizers(optimizer) -> list:
    """The megatron optimizers a step walks: those inside a ``ChainedOptimizer`` (dense and expert
    parameters, or one per LoRA group), else ``[optimizer]`` itself."""
    chained = getattr(optimizer, "chained_optimizers", None)
    return list(chained) if chained is not None else [optimizer]


def torch_optimizers(optimizer):
    """The torch optimizers inside a megatron optimizer (chained, mixed precision, FP32)."""
    import torch
    if isinstance(optimizer, torch.optim.Optimizer):
        yield optimizer
        return
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:   # its .optimizer asserts there is exactly one
        for child in chained:
            yield from torch_optimizers(child)
        return
    inner = getattr(optimizer, "optimizer", None)
    if inner is not None:
        yield from torch_optimizers(inner)


def implementation(optimizer) -> str:
    """Which Adam implementation runs ``optimizer``'s step: ``"torch fused"``, ``"torch foreach"``,
    ``"torch per-tensor"`` (torch's Adam/AdamW), or the class name of another (TE's or apex's
    FusedAdam); several chained optimizers are listed once each, in order."""
    import torch
    names = []
    for inner in torch_optimizers(optimizer):
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            g = inner.param_groups[0] if inner.param_groups else {}
            name = ("torch fused" if g.get("fused") else "torch foreach" if g.get("foreach")
                    else "torch per-tensor")
        else:
            name = type(inner).__module__.split(".")[0] + " " + type(inner).__name__
        if name not in names:
            names.append(name)
    return ", ".join(names) or type(optimizer).__name__
