"""Autograd Functions of the RMSNorm family on the C++ CPU backend (``csrc/norm``).

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


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, offset):
        x2 = _rows(x)
        w = _weight32(weight)
        y = _alloc.empty_like(x2)
        rstd = _alloc.empty(x2.shape[0], dtype=torch.float32, device=x.device)
        _cpu_ext.ops().rms_norm_fwd(x2, w, eps, offset, y, rstd)
        ctx.save_for_backward(x2, w, rstd)
        ctx.offset, ctx.shape, ctx.wdtype = offset, x.shape, weight.dtype
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, w, rstd = ctx.saved_tensors
        dy2 = _rows(dy.to(x2.dtype))
        dx = _alloc.empty_like(x2)
        need_dw = ctx.needs_input_grad[1]
        scratch = _dw_scratch(x2.shape[1], need_dw)
        _cpu_ext.ops().rms_norm_bwd(dy2, x2, w, rstd, ctx.offset, dx, scratch)
        dw = _dw(scratch, ctx.wdtype) if need_dw else None
        return dx.view(ctx.shape), dw, None, None


class GatedRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate, weight, eps):
        x2, g2 = _rows(x), _rows(gate)
        w = _weight32(weight)
        y = _alloc.empty_like(x2)
        rstd = _alloc.empty(x2.shape[0], dtype=torch.float32, device=x.device)
        _cpu_ext.ops().gated_rms_norm_fwd(x2, g2, w, eps, y, rstd)
        ctx.save_for_backward(x2, g2, w, rstd)
        ctx.shape, ctx.wdtype = x.shape, weight.dtype
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, g2, w, rstd = ctx.saved_tensors
        dy2 = _rows(dy.to(x2.dtype))
        dx = _alloc.empty_like(x2)
        dg = _alloc.empty_like(x2)
        need_dw = ctx.needs_input_grad[2]
        scratch = _dw_scratch(x2.shape[1], need_dw)
        _cpu_ext.ops().gated_rms_norm_bwd(dy2, x2, g2, w, rstd, dx, dg, scratch)
        dw = _dw(scratch, ctx.wdtype) if need_dw else None
        return dx.view(ctx.shape), dg.view(ctx.shape), dw, None


def rms_norm(x, weight, eps, offset):
    return RMSNormFunction.apply(x, weight, eps, offset)


def gated_rms_norm(x, gate, weight, eps):
    return GatedRMSNormFunction.apply(x, gate, weight, eps)
