""":func:`twinkle_kernels.adamw_step` on the C++ CPU backend (``csrc/optim/adamw.cpp``)."""
from __future__ import annotations

from typing import Optional

from .. import _cpu_ext


def missing_reason() -> Optional[str]:
    """Why the loaded C++ build cannot serve the op (one built before it existed), or None."""
    op = getattr(_cpu_ext.ops(), "adamw_step", None)
    if op is None:
        return "the loaded C++ extension predates adamw_step: rebuild it"
    if "zero_grads" not in [a.name for a in op.default._schema.arguments]:
        return "the loaded C++ extension's adamw_step predates zero_grads: rebuild it"
    return None


def adamw_step(params, grads, exp_avgs, exp_avg_sqs, steps, out_params, *, lr, beta1, beta2, eps,
               weight_decay, grad_factor, zero_grads=False) -> None:
    _cpu_ext.ops().adamw_step(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), list(steps),
                              list(out_params or ()), lr, beta1, beta2, eps, weight_decay, grad_factor,
                              zero_grads)
