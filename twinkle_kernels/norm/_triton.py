"""Triton kernels and autograd Functions of the RMSNorm family (plain, zero-centred, gated).

One kernel pair serves all three: ``HAS_GATE`` adds the ``silu(gate)`` factor and
``offset`` shifts the weight (``offset + weight``). Statistics and all math are fp32;
inputs and outputs keep their dtypes (weight may differ from x, e.g. fp32 master weights
with bf16 activations).

Forward: a program normalises a ``[BLOCK_M, BLOCK_N]`` tile of whole rows and stores the
row's ``rstd`` for the backward. Backward: a fixed number of programs each walk a
contiguous run of row tiles, write dx (and dgate), and accumulate their share of dweight
in registers; the per-program partial sums ``[programs, N]`` are then summed once, so
the weight gradient is deterministic.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .. import _alloc
from .._triton_utils import TILE_ELEMS, next_pow2, num_warps, on_device, program_budget, rows


@triton.jit(do_not_specialize=["M"])  # row counts vary per batch: one compile
def _norm_fwd_kernel(X, GATE, W, Y, RSTD, M, N, stride_x, stride_g, stride_y, eps, offset,
                     HAS_GATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    r = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.arange(0, BLOCK_N)
    rmask = r < M
    cmask = c < N
    mask = rmask[:, None] & cmask[None, :]
    r64 = r.to(tl.int64)
    x = tl.load(X + r64[:, None] * stride_x + c[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    w = tl.load(W + c, mask=cmask, other=0.0).to(tl.float32) + offset
    y = x * rstd[:, None] * w[None, :]
    if HAS_GATE:
        z = tl.load(GATE + r64[:, None] * stride_g + c[None, :], mask=mask, other=0.0).to(tl.float32)
        y = y * z / (1.0 + tl.exp(-z))
    tl.store(Y + r64[:, None] * stride_y + c[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + r, rstd, mask=rmask)


@triton.jit(do_not_specialize=["M", "tiles_per_prog"])
def _norm_bwd_kernel(DY, X, GATE, W, RSTD, DX, DGATE, DW_PART, M, N, tiles_per_prog,
                     stride_dy, stride_x, stride_g, stride_dx, stride_dg, offset,
                     HAS_GATE: tl.constexpr, NEED_DW: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    c = tl.arange(0, BLOCK_N)
    cmask = c < N
    w = tl.load(W + c, mask=cmask, other=0.0).to(tl.float32) + offset
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for i in range(0, tiles_per_prog):
        r = (pid * tiles_per_prog + i) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = r < M
        mask = rmask[:, None] & cmask[None, :]
        r64 = r.to(tl.int64)
        x = tl.load(X + r64[:, None] * stride_x + c[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + r64[:, None] * stride_dy + c[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + r, mask=rmask, other=0.0)
        xhat = x * rstd[:, None]
        if HAS_GATE:
            z = tl.load(GATE + r64[:, None] * stride_g + c[None, :], mask=mask, other=0.0).to(tl.float32)
            sig = 1.0 / (1.0 + tl.exp(-z))
            # d silu(z)/dz = sig * (1 + z * (1 - sig))
            dz = dy * xhat * w[None, :] * sig * (1.0 + z * (1.0 - sig))
            tl.store(DGATE + r64[:, None] * stride_dg + c[None, :], dz.to(DGATE.dtype.element_ty), mask=mask)
            dy = dy * z * sig
        g = dy * w[None, :]
        proj = tl.sum(g * xhat, axis=1) / N
        dx = (g - xhat * proj[:, None]) * rstd[:, None]
        tl.store(DX + r64[:, None] * stride_dx + c[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if NEED_DW:
            dw_acc += tl.sum(dy * xhat, axis=0)
    if NEED_DW:
        tl.store(DW_PART + pid * N + c, dw_acc, mask=cmask)


def _blocks(n: int, m: int, budget: int):
    block_n = next_pow2(n)
    block_m = max(1, min(budget // block_n, next_pow2(m)))
    return block_m, block_n


def _forward(x2: torch.Tensor, g2: Optional[torch.Tensor], w: torch.Tensor, eps: float, offset: float):
    m, n = x2.shape
    y = _alloc.empty(m, n, dtype=x2.dtype, device=x2.device)
    rstd = _alloc.empty(m, dtype=torch.float32, device=x2.device)
    if m and n:
        block_m, block_n = _blocks(n, m, TILE_ELEMS)
        gate = g2 if g2 is not None else x2
        with on_device(x2):
            _norm_fwd_kernel[(triton.cdiv(m, block_m),)](
                x2, gate, w, y, rstd, m, n, x2.stride(0), gate.stride(0), y.stride(0), eps, offset,
                HAS_GATE=g2 is not None, BLOCK_M=block_m, BLOCK_N=block_n,
                num_warps=num_warps(block_m * block_n))
    return y, rstd


def _backward(dy2, x2, g2, w, rstd, offset: float, need_dw: bool):
    m, n = x2.shape
    dx = _alloc.empty(m, n, dtype=x2.dtype, device=x2.device)
    dg = _alloc.empty(m, n, dtype=g2.dtype, device=x2.device) if g2 is not None else None
    if not (m and n):
        dw = torch.zeros(n, dtype=torch.float32, device=x2.device) if need_dw else None
        return dx, dg, dw
    block_m, block_n = _blocks(n, m, TILE_ELEMS // 2)
    tiles = triton.cdiv(m, block_m)
    programs = min(tiles, program_budget(x2.device))
    tiles_per_prog = triton.cdiv(tiles, programs)
    programs = triton.cdiv(tiles, tiles_per_prog)
    part = _alloc.empty(programs if need_dw else 1, n, dtype=torch.float32, device=x2.device)
    gate, dgate = (g2, dg) if g2 is not None else (x2, dx)
    with on_device(x2):
        _norm_bwd_kernel[(programs,)](
            dy2, x2, gate, w, rstd, dx, dgate, part, m, n, tiles_per_prog,
            dy2.stride(0), x2.stride(0), gate.stride(0), dx.stride(0), dgate.stride(0), offset,
            HAS_GATE=g2 is not None, NEED_DW=need_dw, BLOCK_M=block_m, BLOCK_N=block_n,
            num_warps=num_warps(block_m * block_n))
    return dx, dg, (part.sum(0) if need_dw else None)


def rms_norm_forward(x, weight, eps, offset):
    """x: ``[..., N]``, weight: ``[N]`` -> (y ``[..., N]`` in x's dtype, rstd fp32 ``[M]``, M rows)."""
    y, rstd = _forward(rows(x), None, weight.contiguous(), eps, offset)
    return y.view(x.shape), rstd


def rms_norm_backward(dy, x, weight, rstd, offset, need_dw=True):
    """The forward's rstd ``[M]`` -> (dx in x's shape and dtype, dweight in weight's dtype or None)."""
    w = weight.contiguous()
    dx, _, dw = _backward(rows(dy), rows(x), None, w, rstd.reshape(-1), offset, need_dw)
    return dx.view(x.shape), (dw.to(w.dtype) if need_dw else None)


def gated_rms_norm_forward(x, gate, weight, eps):
    """x, gate: ``[..., N]``, weight: ``[N]`` -> (y ``[..., N]`` in x's dtype, rstd fp32 ``[M]``)."""
    y, rstd = _forward(rows(x), rows(gate), weight.contiguous(), eps, 0.0)
    return y.view(x.shape), rstd


def gated_rms_norm_backward(dy, x, gate, weight, rstd, need_dw=True):
    """The forward's rstd ``[M]`` -> (dx, dgate in x's shape and dtype, dweight in weight's dtype or None)."""
    w = weight.contiguous()
    dx, dg, dw = _backward(rows(dy), rows(x), rows(gate), w, rstd.reshape(-1), 0.0, need_dw)
    return dx.view(x.shape), dg.view(x.shape), (dw.to(w.dtype) if need_dw else None)


class RMSNormFunction(torch.autograd.Function):
    """``y = x * rstd * (offset + w)``; x: ``[..., N]``, weight: ``[N]``."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset):
        x2 = rows(x)  # saved as rows: a non-contiguous x is copied once
        y, rstd = rms_norm_forward(x2, weight, eps, offset)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.offset, ctx.shape = offset, x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(dy, x2, weight, rstd, ctx.offset, ctx.needs_input_grad[1])
        return dx.view(ctx.shape), dw, None, None


class GatedRMSNormFunction(torch.autograd.Function):
    """``y = x * rstd * w * silu(gate)``; x, gate: ``[..., N]``, weight: ``[N]``."""

    @staticmethod
    def forward(ctx, x, gate, weight, eps):
        x2, g2 = rows(x), rows(gate)
        y, rstd = gated_rms_norm_forward(x2, g2, weight, eps)
        ctx.save_for_backward(x2, g2, weight, rstd)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, g2, weight, rstd = ctx.saved_tensors
        dx, dg, dw = gated_rms_norm_backward(dy, x2, g2, weight, rstd, ctx.needs_input_grad[2])
        return dx.view(ctx.shape), dg.view(ctx.shape), dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """x: ``[..., N]`` fp32/bf16/fp16 (CUDA, or CPU under ``TRITON_INTERPRET=1``); weight: ``[N]``."""
    return RMSNormFunction.apply(x, weight, eps, offset)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x, gate: ``[..., N]`` same dtype; weight: ``[N]``; returns ``[..., N]`` in x.dtype."""
    return GatedRMSNormFunction.apply(x, gate, weight, eps)
