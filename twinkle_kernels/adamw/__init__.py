"""One AdamW step over many tensors, with the gradient scaled on the fly and the model's
low-precision copy written in the same pass: the update of a mixed-precision optimizer whose
master weights and moments are float32.

Backends: ``reference`` (:mod:`.reference`, torch's own per-tensor AdamW update) and ``cpu``
(C++ in ``csrc/optim``, :mod:`._cpu`). On other devices the reference serves; there the fused
optimizers of torch, apex or Transformer Engine already make one pass.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .. import _checks, _dispatch
from .reference import adamw_step_reference

__all__ = ["adamw_step", "adamw_step_reference"]

_OP = _dispatch.op("adamw_step")
_OP.register("reference")(adamw_step_reference)

_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def adamw_step(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
               exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor],
               steps: Sequence[torch.Tensor], *, lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
               weight_decay: float = 0.0, grad_factor: float = 1.0,
               out_params: Optional[Sequence[torch.Tensor]] = None, zero_grads: bool = False,
               backend: Optional[str] = None) -> None:
    """``torch.optim.AdamW``'s update of each ``params[k]`` from ``grads[k] * grad_factor``, in place.

    Per tensor, with ``g = grads[k] * grad_factor`` and ``t = steps[k]`` after it is incremented::

        p = p * (1 - lr * weight_decay)
        m = lerp(m, g, 1 - beta1)
        v = v * beta2 + (1 - beta2) * g * g
        p = p - lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)

    and ``out_params[k]`` (when given) receives the new ``p`` rounded to its dtype. fp32
    arithmetic per element, as torch's AdamW. The grads are only read, unless ``zero_grads``:
    then each is set to zero in the same pass (an accumulation buffer ready for the next step).

    ``grad_factor`` folds a scaling that would otherwise be its own pass over the grads (megatron's
    1 / tokens normalisation times the clipping coefficient); ``out_params`` folds the copy of the
    float32 master weights into the model's bfloat16 / float16 parameters.

    Args:
        params: contiguous float32 tensors (the master weights), updated in place.
        exp_avgs: contiguous float32 tensors shaped as the params (the first moments), updated in place.
        exp_avg_sqs: contiguous float32 tensors shaped as the params (the second moments), updated
            in place.
        grads: float32 / bfloat16 / float16 tensors shaped as the params (a non-contiguous one is
            read through a contiguous copy).
        steps: one-element float32 tensors, each param's step count (torch's ``state["step"]``),
            incremented by one.
        lr: the learning rate, >= 0 (as ``torch.optim.AdamW``'s).
        betas: ``(beta1, beta2)``, each in [0, 1).
        eps: added to the denominator, > 0.
        weight_decay: decoupled weight decay, >= 0.
        grad_factor: a finite number >= 0 each gradient is multiplied by.
        out_params: None, or contiguous float32 / bfloat16 / float16 tensors shaped as the params.
        zero_grads: zero every grad after it is read (the grads must then be contiguous).
        backend: ``None``/"auto", "reference" or "cpu".

    All the tensors are on one device. Every argument is checked before anything is written: a bad one raises naming it and leaves
    every tensor as it was.

    Example::

        st = [opt.state[p] for p in params]
        adamw_step(params, [p.grad for p in params], [s["exp_avg"] for s in st],
                   [s["exp_avg_sq"] for s in st], [s["step"] for s in st], lr=1e-4,
                   weight_decay=0.01, grad_factor=1 / num_tokens, out_params=bf16_params)
    """
    lists = dict(params=params, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs, steps=steps)
    if out_params is not None:
        lists["out_params"] = out_params
    for name, xs in lists.items():
        if isinstance(xs, torch.Tensor) or not isinstance(xs, (list, tuple)):
            raise TypeError(f"{name} must be a list or tuple of tensors, got {type(xs).__name__}")
        if len(xs) != len(params):
            raise ValueError(f"{name} has {len(xs)} tensors but params has {len(params)}; one per param")
    if not isinstance(zero_grads, bool):
        raise TypeError(f"zero_grads must be a bool, got {zero_grads!r}")
    lr = _checks.nonneg_float("lr", lr)
    weight_decay = _checks.nonneg_float("weight_decay", weight_decay)
    grad_factor = _checks.nonneg_float("grad_factor", grad_factor)
    eps = _checks.positive_float("eps", eps)
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"betas must be a pair of numbers, got {betas!r}")
    beta1, beta2 = (_checks.finite_float(f"betas[{i}]", b) for i, b in enumerate(betas))
    for i, b in enumerate((beta1, beta2)):
        if not 0.0 <= b < 1.0:
            raise ValueError(f"betas[{i}] must be in [0, 1), got {b}")
    if not params:
        return
    for k, p in enumerate(params):
        _state(f"params[{k}]", p, p)
        _state(f"exp_avgs[{k}]", exp_avgs[k], p)
        _state(f"exp_avg_sqs[{k}]", exp_avg_sqs[k], p)
        _checks.tensor(f"grads[{k}]", grads[k])
        if grads[k].dtype not in _GRAD_DTYPES:
            raise TypeError(f"grads[{k}] has dtype {grads[k].dtype}; expected float32, bfloat16 or float16")
        _checks.same_shape((f"params[{k}]", f"grads[{k}]"), (p, grads[k]))
        if zero_grads and not grads[k].is_contiguous():
            raise ValueError(f"grads[{k}] must be contiguous with zero_grads=True (it is zeroed in place)")
        s = steps[k]
        if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or s.numel() != 1:
            raise TypeError(f"steps[{k}] must be a one-element float32 tensor (torch's state['step']), got "
                            f"{s.dtype if isinstance(s, torch.Tensor) else type(s).__name__}")
        if out_params is not None:
            o = out_params[k]
            _checks.tensor(f"out_params[{k}]", o)
            if o.dtype not in _GRAD_DTYPES:
                raise TypeError(f"out_params[{k}] has dtype {o.dtype}; expected float32, bfloat16 or float16")
            _checks.same_shape((f"params[{k}]", f"out_params[{k}]"), (p, o))
            if not o.is_contiguous():
                raise ValueError(f"out_params[{k}] must be contiguous (it is written in place)")
        names = [f"{n}[{k}]" for n in lists]
        _checks.same_device(names, [xs[k] for xs in lists.values()])
    _OP(params[0].device, backend, params, [g if g.is_contiguous() else g.contiguous() for g in grads],
        exp_avgs, exp_avg_sqs, steps, out_params, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
        weight_decay=weight_decay, grad_factor=grad_factor, zero_grads=zero_grads)


def _state(name: str, t, p) -> None:
    """An in-place float32 operand: a contiguous float32 tensor shaped as its param."""
    _checks.tensor(name, t)
    if t.dtype != torch.float32:
        raise TypeError(f"{name} must be float32 (the optimizer's master weights and moments), got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (it is updated in place)")
    if t is not p:
        _checks.same_shape(("params" + name[name.index("["):], name), (p, t))


def _cpu_verify(params, *args, **kwargs) -> Optional[str]:
    if params[0].device.type != "cpu":
        return f"the cpu backend needs CPU tensors (got {params[0].device.type})"
    from . import _cpu
    return _cpu.missing_reason()


@_OP.register("cpu", verify=_cpu_verify)
def _adamw_cpu(params, grads, exp_avgs, exp_avg_sqs, steps, out_params, **hyper):
    from . import _cpu
    _cpu.adamw_step(params, grads, exp_avgs, exp_avg_sqs, steps, out_params, **hyper)
