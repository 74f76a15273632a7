"""The public row-wise ops as ``torch.library`` custom ops, so ``torch.compile`` can trace them.

Dynamo cannot look inside the C++ / Triton kernels (it would run them on fake tensors), so under
``torch.compile`` each public function calls one opaque op of namespace ``twinkle`` instead:

- the fake (meta) implementation gives the exact output shapes and dtypes (contiguous, as every
  backend returns them); no op mutates or aliases its inputs;
- backend selection (``backend=``, ``TWINKLE_KERNELS_BACKEND``, the device) runs *inside* the op
  at run time, exactly as in eager mode, so the graph holds no branch on it and nothing to guard;
- the backward is an op of its own (``<name>_backward``) that calls the selected backend's own
  backward kernel, as the eager autograd Functions do: the forward op returns the statistics that
  kernel needs as extra outputs (``rms_norm`` / ``gated_rms_norm``: ``rstd``, one per row, the same
  for every backend), the backward op takes them, and nothing is recomputed. SwiGLU needs its
  inputs only, the rotary embedding (linear in q and k) only cos / sin. A backend without a
  backward kernel of its own (``reference``; ``npu``, whose torch_npu operators carry their own
  autograd) is differentiated by rerunning its forward under autograd (:func:`_vjp`).
- the backward op selects the backend again from the same arguments, so it is the forward's
  (and as the statistics are the same for every backend, a change of ``TWINKLE_KERNELS_BACKEND``
  between forward and backward still gives the right gradients).

Eager calls do not go through these ops (no dispatcher overhead): ``torch.compiler.is_compiling()``
selects them while tracing only. ``torch.library.opcheck`` checks every op (tests/test_compile.py).

The other public ops follow the same rules in their own modules: ``_library_moe`` (grouped_matmul,
moe_experts), ``_library_gdn`` (the gated delta rule, causal conv1d and its in-place decode step)
and ``_library_linear_ce`` (fused_linear_cross_entropy).

Shapes and dtypes: as the public functions (``rms_norm``: x ``[..., N]``, weight ``[N]`` -> (y in x's
shape and dtype, rstd ``x.shape[:-1]`` fp32, fp64 for fp64 x); ``gated_rms_norm``: x, gate ``[..., N]``,
the same two outputs; ``swiglu``: gate, up same shape; ``swiglu_packed``: ``[..., 2n]`` -> ``[..., n]``;
``apply_rotary_pos_emb``: (q, k) -> same shapes).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import torch

NS = "twinkle"


def _autograd_inside():
    """An op's kernel runs below the autograd dispatch keys; the backward's recompute needs them."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in (torch._C.DispatchKey.AutogradCPU, torch._C.DispatchKey.AutogradCUDA,
                torch._C.DispatchKey.ADInplaceOrView):
        exclude = exclude.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


def _vjp(fn: Callable, inputs: Sequence[torch.Tensor], grads: Sequence[Optional[torch.Tensor]],
         wrt: Sequence[int]) -> Tuple[torch.Tensor, ...]:
    """Gradients of ``fn(*inputs)`` with respect to ``inputs[i] for i in wrt`` (zeros where unused)."""
    with _autograd_inside(), torch.enable_grad():
        xs = [t.detach().requires_grad_(i in wrt) for i, t in enumerate(inputs)]
        out = fn(*xs)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None]
        got = torch.autograd.grad([o for o, _ in pairs], [xs[i] for i in wrt], [g for _, g in pairs],
                                  allow_unused=True)
    return tuple(torch.zeros_like(inputs[i]) if g is None else g for i, g in zip(wrt, got))


def _dispatch(name: str):
    from . import _dispatch as d
    return d.op(name)


def _select(name: str, device: torch.device, backend: Optional[str], *args):
    """(the op's registry entry, the backend that serves this call, its Stages or None)."""
    op = _dispatch(name)
    chosen = op.select(device, backend, *args)
    return op, chosen, op.stages.get(chosen)


def _new(t: torch.Tensor, shape=None, dtype=None) -> torch.Tensor:
    return t.new_empty(t.shape if shape is None else shape, dtype=dtype or t.dtype)


# -- rms_norm ----------------------------------------------------------------------------------

def _stat_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``rsqrt(mean(x**2, -1) + eps)``, for the backends whose forward does not return it."""
    return torch.rsqrt(x.to(_stat_dtype(x)).pow(2).mean(-1) + eps)


def _norm_forward(name: str, backend: Optional[str], x: torch.Tensor, eps: float, args: tuple):
    """``(y, rstd)`` of norm op ``name`` on ``args`` (its forward's arguments, ``x`` first): the
    backend's forward stage where it has one, else its function and ``rstd`` computed here."""
    op, chosen, stages = _select(name, x.device, backend, *args)
    if stages is not None:
        y, rstd = stages.forward(*args)
    else:
        y, rstd = op.impls[chosen].fn(*args), _rstd(x, eps)
    return y.contiguous(), rstd.reshape(x.shape[:-1])


@torch.library.custom_op(f"{NS}::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
             backend: Optional[str]) -> Tuple[torch.Tensor, torch.Tensor]:
    return _norm_forward("rms_norm", backend, x, eps, (x, weight, eps, offset))


@rms_norm.register_fake
def _(x, weight, eps, offset, backend):
    return _new(x), _new(x, x.shape[:-1], _stat_dtype(x))


@torch.library.custom_op(f"{NS}::rms_norm_backward", mutates_args=())
def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, eps: float,
                      offset: float, backend: Optional[str]) -> Tuple[torch.Tensor, torch.Tensor]:
    op, chosen, stages = _select("rms_norm", x.device, backend, x, weight, eps, offset)
    if stages is None:
        fn = op.impls[chosen].fn
        return _vjp(lambda a, w: fn(a, w, eps, offset), (x, weight), (dy,), (0, 1))
    dx, dw = stages.backward(dy, x, weight, rstd, offset)
    return dx.contiguous(), dw


@rms_norm_backward.register_fake
def _(dy, x, weight, rstd, eps, offset, backend):
    return _new(x), _new(weight)


def _rms_setup(ctx, inputs, output):
    x, weight, ctx.eps, ctx.offset, ctx.backend = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.mark_non_differentiable(output[1])


def _rms_bwd(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = rms_norm_backward(dy, x, weight, rstd, ctx.eps, ctx.offset, ctx.backend)
    return dx, dw, None, None, None


rms_norm.register_autograd(_rms_bwd, setup_context=_rms_setup)


# -- gated_rms_norm ----------------------------------------------------------------------------

@torch.library.custom_op(f"{NS}::gated_rms_norm", mutates_args=())
def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   backend: Optional[str]) -> Tuple[torch.Tensor, torch.Tensor]:
    return _norm_forward("gated_rms_norm", backend, x, eps, (x, gate, weight, eps))


@gated_rms_norm.register_fake
def _(x, gate, weight, eps, backend):
    return _new(x), _new(x, x.shape[:-1], _stat_dtype(x))


@torch.library.custom_op(f"{NS}::gated_rms_norm_backward", mutates_args=())
def gated_rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                            rstd: torch.Tensor, eps: float, backend: Optional[str]
                            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    op, chosen, stages = _select("gated_rms_norm", x.device, backend, x, gate, weight, eps)
    if stages is None:
        fn = op.impls[chosen].fn
        return _vjp(lambda a, g, w: fn(a, g, w, eps), (x, gate, weight), (dy,), (0, 1, 2))
    dx, dg, dw = stages.backward(dy, x, gate, weight, rstd)
    return dx.contiguous(), dg.contiguous(), dw


@gated_rms_norm_backward.register_fake
def _(dy, x, gate, weight, rstd, eps, backend):
    return _new(x), _new(gate), _new(weight)


def _gated_setup(ctx, inputs, output):
    x, gate, weight, ctx.eps, ctx.backend = inputs
    ctx.save_for_backward(x, gate, weight, output[1])
    ctx.mark_non_differentiable(output[1])


def _gated_bwd(ctx, dy, _drstd):
    x, gate, weight, rstd = ctx.saved_tensors
    return (*gated_rms_norm_backward(dy, x, gate, weight, rstd, ctx.eps, ctx.backend), None, None)


gated_rms_norm.register_autograd(_gated_bwd, setup_context=_gated_setup)


# -- swiglu ------------------------------------------------------------------------------------

@torch.library.custom_op(f"{NS}::swiglu", mutates_args=())
def swiglu(gate: torch.Tensor, up: torch.Tensor, backend: Optional[str]) -> torch.Tensor:
    return _dispatch("swiglu")(gate.device, backend, gate, up).contiguous()


@swiglu.register_fake
def _(gate, up, backend):
    return _new(gate)


@torch.library.custom_op(f"{NS}::swiglu_backward", mutates_args=())
def swiglu_backward(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                    backend: Optional[str]) -> Tuple[torch.Tensor, torch.Tensor]:
    op, chosen, stages = _select("swiglu", gate.device, backend, gate, up)
    if stages is None:
        return _vjp(op.impls[chosen].fn, (gate, up), (dy,), (0, 1))
    dg, du = stages.backward(dy, gate, up)
    return dg.contiguous(), du.contiguous()


@swiglu_backward.register_fake
def _(dy, gate, up, backend):
    return _new(gate), _new(up)


def _swiglu_setup(ctx, inputs, output):
    gate, up, ctx.backend = inputs
    ctx.save_for_backward(gate, up)


def _swiglu_bwd(ctx, dy):
    gate, up = ctx.saved_tensors
    return (*swiglu_backward(dy, gate, up, ctx.backend), None)


swiglu.register_autograd(_swiglu_bwd, setup_context=_swiglu_setup)


@torch.library.custom_op(f"{NS}::swiglu_packed", mutates_args=())
def swiglu_packed(x: torch.Tensor, backend: Optional[str]) -> torch.Tensor:
    return _dispatch("swiglu_packed")(x.device, backend, x).contiguous()


@swiglu_packed.register_fake
def _(x, backend):
    return _new(x, (*x.shape[:-1], x.shape[-1] // 2))


@torch.library.custom_op(f"{NS}::swiglu_packed_backward", mutates_args=())
def swiglu_packed_backward(dy: torch.Tensor, x: torch.Tensor, backend: Optional[str]) -> torch.Tensor:
    op, chosen, stages = _select("swiglu_packed", x.device, backend, x)
    if stages is None:
        return _vjp(op.impls[chosen].fn, (x,), (dy,), (0,))[0]
    return stages.backward(dy, x).contiguous()


@swiglu_packed_backward.register_fake
def _(dy, x, backend):
    return _new(x)


def _packed_setup(ctx, inputs, output):
    x, ctx.backend = inputs
    ctx.save_for_backward(x)


def _packed_bwd(ctx, dy):
    (x,) = ctx.saved_tensors
    return swiglu_packed_backward(dy, x, ctx.backend), None


swiglu_packed.register_autograd(_packed_bwd, setup_context=_packed_setup)


# -- apply_rotary_pos_emb ------------------------------------------------------------------------

@torch.library.custom_op(f"{NS}::apply_rotary_pos_emb", mutates_args=())
def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int,
                         backend: Optional[str]) -> Tuple[torch.Tensor, torch.Tensor]:
    qo, ko = _dispatch("apply_rotary_pos_emb")(q.device, backend, q, k, cos, sin, unsqueeze_dim)
    return qo.contiguous(), ko.contiguous()


@apply_rotary_pos_emb.register_fake
def _(q, k, cos, sin, unsqueeze_dim, backend):
    return _new(q), _new(k)  # in q's and k's dtypes, whatever cos / sin hold


@torch.library.custom_op(f"{NS}::apply_rotary_pos_emb_backward", mutates_args=())
def apply_rotary_pos_emb_backward(dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                  unsqueeze_dim: int, backend: Optional[str]) -> Tuple[torch.Tensor, torch.Tensor]:
    """The op is linear in q and k: its vector-Jacobian product does not depend on them, so the
    backward takes cos / sin only (dq / dk stand in for q / k in the selection and the rerun)."""
    op, chosen, stages = _select("apply_rotary_pos_emb", dq.device, backend, dq, dk, cos, sin, unsqueeze_dim)
    if stages is None:
        fn = op.impls[chosen].fn
        return _vjp(lambda a, b: fn(a, b, cos, sin, unsqueeze_dim), (dq, dk), (dq, dk), (0, 1))
    gq, gk = stages.backward(dq, dk, cos, sin, unsqueeze_dim)
    return gq.contiguous(), gk.contiguous()


@apply_rotary_pos_emb_backward.register_fake
def _(dq, dk, cos, sin, unsqueeze_dim, backend):
    return _new(dq), _new(dk)


def _rope_setup(ctx, inputs, output):
    _, _, cos, sin, ctx.unsqueeze_dim, ctx.backend = inputs
    ctx.save_for_backward(cos, sin)


def _rope_bwd(ctx, dq, dk):
    cos, sin = ctx.saved_tensors
    # cos / sin are not differentiated, as in the cpu and triton backends (transformers computes
    # them from buffers under no_grad)
    gq, gk = apply_rotary_pos_emb_backward(dq, dk, cos, sin, ctx.unsqueeze_dim, ctx.backend)
    return gq, gk, None, None, None, None


apply_rotary_pos_emb.register_autograd(_rope_bwd, setup_context=_rope_setup)

OPS = ("rms_norm", "gated_rms_norm", "swiglu", "swiglu_packed", "apply_rotary_pos_emb")
