"""RMSNorm and the gated RMSNorm as ``torch.library`` custom ops
(the rules: :mod:`twinkle_kernels._custom_ops`).

The forward op returns the statistics the backward kernel needs as an extra output: ``rstd``,
one per row, the same for every backend (so a change of ``TWINKLE_KERNELS_BACKEND`` between
forward and backward still gives the right gradients).

Shapes and dtypes: as the public functions (``rms_norm``: x ``[..., N]``, weight ``[N]`` -> (y in
x's shape and dtype, rstd ``x.shape[:-1]`` fp32, fp64 for fp64 x); ``gated_rms_norm``: x, gate
``[..., N]``, the same two outputs).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._custom_ops import NS, new_like, select, vjp

# -- rms_norm ----------------------------------------------------------------------------------

def _stat_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``rsqrt(mean(x**2, -1) + eps)``, for the backends whose forward does not return it."""
    return torch.rsqrt(x.to(_stat_dtype(x)).pow(2).mean(-1) + eps)


def _norm_forward(name: str, backend: Optional[str], x: torch.Tensor, eps: float, args: tuple):
    """``(y, rstd)`` of norm op ``name`` on ``args`` (its forward's arguments, ``x`` first): the
    backend's forward stage where it has one, else its function and ``rstd`` computed here."""
    op, chosen, stages = select(name, x.device, backend, *args)
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
    return new_like(x), new_like(x, x.shape[:-1], _stat_dtype(x))


@torch.library.custom_op(f"{NS}::rms_norm_backward", mutates_args=())
def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, eps: float,
                      offset: float, backend: Optional[str]) -> Tuple[torch.Tensor, torch.Tensor]:
    op, chosen, stages = select("rms_norm", x.device, backend, x, weight, eps, offset)
    if stages is None:
        fn = op.impls[chosen].fn
        return vjp(lambda a, w: fn(a, w, eps, offset), (x, weight), (dy,), (0, 1))
    dx, dw = stages.backward(dy, x, weight, rstd, offset)
    return dx.contiguous(), dw


@rms_norm_backward.register_fake
def _(dy, x, weight, rstd, eps, offset, backend):
    return new_like(x), new_like(weight)


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
    return new_like(x), new_like(x, x.shape[:-1], _stat_dtype(x))


@torch.library.custom_op(f"{NS}::gated_rms_norm_backward", mutates_args=())
def gated_rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                            rstd: torch.Tensor, eps: float, backend: Optional[str]
                            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    op, chosen, stages = select("gated_rms_norm", x.device, backend, x, gate, weight, eps)
    if stages is None:
        fn = op.impls[chosen].fn
        return vjp(lambda a, g, w: fn(a, g, w, eps), (x, gate, weight), (dy,), (0, 1, 2))
    dx, dg, dw = stages.backward(dy, x, gate, weight, rstd)
    return dx.contiguous(), dg.contiguous(), dw


@gated_rms_norm_backward.register_fake
def _(dy, x, gate, weight, rstd, eps, backend):
    return new_like(x), new_like(gate), new_like(weight)


def _gated_setup(ctx, inputs, output):
    x, gate, weight, ctx.eps, ctx.backend = inputs
    ctx.save_for_backward(x, gate, weight, output[1])
    ctx.mark_non_differentiable(output[1])


def _gated_bwd(ctx, dy, _drstd):
    x, gate, weight, rstd = ctx.saved_tensors
    return (*gated_rms_norm_backward(dy, x, gate, weight, rstd, ctx.eps, ctx.backend), None, None)


gated_rms_norm.register_autograd(_gated_bwd, setup_context=_gated_setup)

OPS = ("rms_norm", "gated_rms_norm")
