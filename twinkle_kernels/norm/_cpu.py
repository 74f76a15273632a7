"""Autograd Functions of the RMSNorm family on the C++ CPU backend (``csrc/norm``)."""
from __future__ import annotations

import torch

from .. import _alloc, _cpu_ext


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def _dw_scratch(n: int, need: bool) -> torch.Tensor:
    # One fp32 row per thread slot; summed in Python (at most num_threads x N).
    if not need:
        return torch.empty(0, dtype=torch.float32)
    return torch.zeros(torch.get_num_threads(), n, dtype=torch.float32)


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, offset):
        x2 = _rows(x)
        w = weight.detach().to(torch.float32).contiguous()
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
        dw = scratch.sum(0).to(ctx.wdtype) if need_dw else None
        return dx.view(ctx.shape), dw, None, None


def rms_norm(x, weight, eps, offset):
    return RMSNormFunction.apply(x, weight, eps, offset)


def gated_rms_norm(x, gate, weight, eps):
    raise NotImplementedError("gated_rms_norm has no C++ kernel yet")
