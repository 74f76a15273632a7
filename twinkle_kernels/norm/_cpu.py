"""The RMSNorm family on the C++ CPU backend (``csrc/norm``): plain RMSNorm's autograd is C++
(the ``rms_norm`` op, the same steps as below), the gated form's a Python Function.

Inputs are viewed as ``[M, N]`` rows (copied only when not contiguous); the weight is
passed as fp32 (no copy when it already is). Weight gradients are accumulated by the
kernels into one fp32 row per task and summed here, in a fixed order, so the result
does not depend on the thread count's scheduling.
"""
from __future__ import annotations

import math

import torch

from .. import _alloc, _cpu_ext


def _rows(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1]
    m = math.prod(x.shape[:-1])
    return x.reshape(m, n).contiguous()


def _weight32(weight: torch.Tensor) -> torch.Tensor:
    w = weight.detach()
    if w.dtype != torch.float32:
        w = w.to(torch.float32)
    return w.contiguous()


def _dw_scratch(n: int, need: bool) -> torch.Tensor:
    # One fp32 row per task (= thread slot); at most num_threads x N, so zeroing it is cheap.
    if not need:
        return torch.empty(0, dtype=torch.float32)
    return torch.zeros(max(1, torch.get_num_threads()), n, dtype=torch.float32)


def _dw(scratch: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    dw = scratch[0] if scratch.shape[0] == 1 else scratch.sum(0)
    return dw.to(dtype)


def rms_norm_forward(x, weight, eps, offset):
    """x: ``[..., N]``, weight: ``[N]`` -> (y ``[..., N]`` in x's dtype, rstd fp32 ``[M]``, M rows)."""
    x2 = _rows(x)
    y = _alloc.empty_like(x2)
    rstd = _alloc.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    _cpu_ext.ops().rms_norm_fwd(x2, _weight32(weight), eps, offset, y, rstd)
    return y.view(x.shape), rstd


def rms_norm_backward(dy, x, weight, rstd, offset, need_dw=True):
    """The forward's rstd ``[M]`` -> (dx in x's shape and dtype, dweight in weight's dtype or None)."""
    x2 = _rows(x)
    dy2 = _rows(dy.to(x2.dtype))
    dx = _alloc.empty_like(x2)
    scratch = _dw_scratch(x2.shape[1], need_dw)
    _cpu_ext.ops().rms_norm_bwd(dy2, x2, _weight32(weight), rstd.reshape(-1), offset, dx, scratch)
    return dx.view(x.shape), (_dw(scratch, weight.dtype) if need_dw else None)


def gated_rms_norm_forward(x, gate, weight, eps):
    """x, gate: ``[..., N]``, weight: ``[N]`` -> (y ``[..., N]`` in x's dtype, rstd fp32 ``[M]``)."""
    x2, g2 = _rows(x), _rows(gate)
    y = _alloc.empty_like(x2)
    rstd = _alloc.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    _cpu_ext.ops().gated_rms_norm_fwd(x2, g2, _weight32(weight), eps, y, rstd)
    return y.view(x.shape), rstd


def gated_rms_norm_backward(dy, x, gate, weight, rstd, need_dw=True):
    """The forward's rstd ``[M]`` -> (dx, dgate in x's shape and dtype, dweight in weight's dtype or None)."""
    x2, g2 = _rows(x), _rows(gate)
    dy2 = _rows(dy.to(x2.dtype))
    dx = _alloc.empty_like(x2)
    dg = _alloc.empty_like(x2)
    scratch = _dw_scratch(x2.shape[1], need_dw)
    _cpu_ext.ops().gated_rms_norm_bwd(dy2, x2, g2, _weight32(weight), rstd.reshape(-1), dx, dg, scratch)
    return dx.view(x.shape), dg.view(x.shape), (_dw(scratch, weight.dtype) if need_dw else None)


class GatedRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate, weight, eps):
        x2, g2 = _rows(x), _rows(gate)
        y, rstd = gated_rms_norm_forward(x2, g2, weight, eps)
        ctx.save_for_backward(x2, g2, weight, rstd)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, g2, weight, rstd = ctx.saved_tensors
        dx, dg, dw = gated_rms_norm_backward(dy, x2, g2, weight, rstd, ctx.needs_input_grad[2])
        return dx.view(ctx.shape), dg.view(ctx.shape), dw, None


def rms_norm(x, weight, eps, offset):
    # forward and backward in C++ (csrc/norm/rms_norm.cpp: torch::autograd::Function): at small
    # hidden sizes a Python autograd.Function cost more than the kernels it ran
    return _cpu_ext.op("rms_norm")(x, weight, float(eps), float(offset), _alloc.poisoning())


def gated_rms_norm(x, gate, weight, eps):
    return GatedRMSNormFunction.apply(x, gate, weight, eps)
