"""What every op's ``torch.library`` module shares (``<op>/_library.py`` in each op package), so
``torch.compile`` can trace the public ops.

Dynamo cannot look inside the C++ / Triton kernels (it would run them on fake tensors), so under
``torch.compile`` each public function calls one opaque op of namespace ``twinkle`` (:data:`NS`)
instead:

- the fake (meta) implementation gives the exact output shapes and dtypes (contiguous, as every
  backend returns them); no op mutates or aliases its inputs unless it says so in ``mutates_args``;
- backend selection (``backend=``, ``TWINKLE_KERNELS_BACKEND``, the device) runs *inside* the op
  at run time, exactly as in eager mode, so the graph holds no branch on it and nothing to guard;
- the backward is an op of its own (``<name>_backward``) that calls the selected backend's own
  backward kernel, as the eager autograd Functions do, from statistics the forward op returns as
  extra outputs where the kernel needs them (nothing is recomputed). A backend without a backward
  kernel of its own (``reference``; ``npu``, whose torch_npu operators carry their own autograd)
  is differentiated by rerunning its forward under autograd (:func:`vjp`);
- the backward op selects the backend again from the same arguments, so it is the forward's.

Eager calls do not go through these ops (no dispatcher overhead): ``torch.compiler.is_compiling()``
selects them while tracing only. ``torch.library.opcheck`` checks every op (tests/kernels/test_compile.py).

The modules: ``norm/_library.py`` (rms_norm, gated_rms_norm), ``swiglu/_library.py``,
``rope/_library.py``, ``moe/_library.py`` (grouped_matmul, moe_experts), ``gdn/_library.py``
(the gated delta rule, causal conv1d and its in-place decode step) and ``linear_ce/_library.py``
(fused_linear_cross_entropy). Each lists its op names in ``OPS``. This module imports no op
package, so an op package's ``_library`` imports only it and the op package's own modules.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import torch

from . import _dispatch

NS = "twinkle"


def autograd_inside():
    """An op's kernel runs below the autograd dispatch keys; the backward's recompute needs them."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in (torch._C.DispatchKey.AutogradCPU, torch._C.DispatchKey.AutogradCUDA,
                torch._C.DispatchKey.ADInplaceOrView):
        exclude = exclude.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


def vjp(fn: Callable, inputs: Sequence[torch.Tensor], grads: Sequence[Optional[torch.Tensor]],
        wrt: Sequence[int]) -> Tuple[torch.Tensor, ...]:
    """Gradients of ``fn(*inputs)`` with respect to ``inputs[i] for i in wrt`` (zeros where unused)."""
    with autograd_inside(), torch.enable_grad():
        xs = [t.detach().requires_grad_(i in wrt) for i, t in enumerate(inputs)]
        out = fn(*xs)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None]
        got = torch.autograd.grad([o for o, _ in pairs], [xs[i] for i in wrt], [g for _, g in pairs],
                                  allow_unused=True)
    return tuple(torch.zeros_like(inputs[i]) if g is None else g for i, g in zip(wrt, got))


def op_entry(name: str):
    """The op's entry in the backend registry (:func:`twinkle_kernels._dispatch.op`)."""
    return _dispatch.op(name)


def select(name: str, device: torch.device, backend: Optional[str], *args):
    """(the op's registry entry, the backend that serves this call, its Stages or None)."""
    op = op_entry(name)
    chosen = op.select(device, backend, *args)
    return op, chosen, op.stages.get(chosen)


def new_like(t: torch.Tensor, shape=None, dtype=None) -> torch.Tensor:
    return t.new_empty(t.shape if shape is None else shape, dtype=dtype or t.dtype)
