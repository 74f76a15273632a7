"""Triton depthwise causal conv1d (transformers' ``causal_conv1d_fn`` layout), forward + backward.

``y[b, d, t] = act(bias[d] + sum_i w[d, i] * x[b, d, t - (W - 1) + i])``; a tap that reaches
before the start of the token's sequence (position 0, or its ``cu_seqlens`` offset) reads zero.
Programs tile ``[BD channels, BT positions]`` of one batch row; math in fp32.

Backward: ``dz = dy * act'(z)`` (z recomputed), ``dx[t] = sum_i w[d, i] dz[t + W - 1 - i]``
over outputs of the same sequence, and per-tile partial sums of ``dw`` / ``dbias`` that the
host adds up (deterministic, no atomics).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _alloc

__all__ = ["causal_conv1d"]


@triton.jit
def _conv_z(x_ptr, w_ptr, b_ptr, st_ptr, xrow, cd, ct, md, T, D, W: tl.constexpr, BD: tl.constexpr,
            BT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_CU: tl.constexpr):
    """Pre-activation z for a [BD, BT] tile (fp32)."""
    mt = ct < T
    if HAS_CU:
        start = tl.load(st_ptr + ct, mask=mt, other=0)
    else:
        start = tl.zeros_like(ct)
    z = tl.zeros([BD, BT], dtype=tl.float32)
    for i in tl.static_range(W):
        src = ct - (W - 1 - i)
        ok = mt & (src >= start)
        xv = tl.load(x_ptr + xrow + cd[:, None].to(tl.int64) * T + src[None, :],
                     mask=md[:, None] & ok[None, :], other=0.0).to(tl.float32)
        wv = tl.load(w_ptr + cd * W + i, mask=md, other=0.0).to(tl.float32)
        z += wv[:, None] * xv
    if HAS_BIAS:
        z += tl.load(b_ptr + cd, mask=md, other=0.0).to(tl.float32)[:, None]
    return z


@triton.jit
def conv_fwd_kernel(x_ptr, w_ptr, b_ptr, st_ptr, y_ptr, D, T, W: tl.constexpr, BD: tl.constexpr,
                    BT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_CU: tl.constexpr, SILU: tl.constexpr):
    i_b = tl.program_id(0)
    cd = tl.program_id(1) * BD + tl.arange(0, BD)
    ct = tl.program_id(2) * BT + tl.arange(0, BT)
    md = cd < D
    xrow = i_b.to(tl.int64) * D * T
    z = _conv_z(x_ptr, w_ptr, b_ptr, st_ptr, xrow, cd, ct, md, T, D, W, BD, BT, HAS_BIAS, HAS_CU)
    if SILU:
        z = z * tl.sigmoid(z)
    off = xrow + cd[:, None].to(tl.int64) * T + ct[None, :]
    tl.store(y_ptr + off, z.to(y_ptr.dtype.element_ty), mask=md[:, None] & (ct < T)[None, :])


@triton.jit
def conv_dz_kernel(x_ptr, w_ptr, b_ptr, st_ptr, dy_ptr, dz_ptr, dw_ptr, db_ptr, D, T, n_tiles,
                   W: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr, HAS_BIAS: tl.constexpr,
                   HAS_CU: tl.constexpr, SILU: tl.constexpr):
    """dz (fp32) and this tile's partial dw [D, W] / dbias [D] (slot b * n_tiles + tile)."""
    i_b = tl.program_id(0)
    i_t = tl.program_id(2)
    cd = tl.program_id(1) * BD + tl.arange(0, BD)
    ct = i_t * BT + tl.arange(0, BT)
    md = cd < D
    mt = ct < T
    m = md[:, None] & mt[None, :]
    xrow = i_b.to(tl.int64) * D * T
    off = xrow + cd[:, None].to(tl.int64) * T + ct[None, :]
    dz = tl.load(dy_ptr + off, mask=m, other=0.0).to(tl.float32)
    if SILU:
        z = _conv_z(x_ptr, w_ptr, b_ptr, st_ptr, xrow, cd, ct, md, T, D, W, BD, BT, HAS_BIAS, HAS_CU)
        s = tl.sigmoid(z)
        dz = dz * s * (1.0 + z * (1.0 - s))
    tl.store(dz_ptr + off, dz, mask=m)
    slot = (i_b * n_tiles + i_t).to(tl.int64)
    if HAS_CU:
        start = tl.load(st_ptr + ct, mask=mt, other=0)
    else:
        start = tl.zeros_like(ct)
    for i in tl.static_range(W):
        src = ct - (W - 1 - i)
        ok = mt & (src >= start)
        xv = tl.load(x_ptr + xrow + cd[:, None].to(tl.int64) * T + src[None, :],
                     mask=md[:, None] & ok[None, :], other=0.0).to(tl.float32)
        tl.store(dw_ptr + slot * D * W + cd * W + i, tl.sum(dz * xv, 1), mask=md)
    if HAS_BIAS:
        tl.store(db_ptr + slot * D + cd, tl.sum(dz, 1), mask=md)


@triton.jit
def conv_dx_kernel(w_ptr, st_ptr, dz_ptr, dx_ptr, D, T, W: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr,
                   HAS_CU: tl.constexpr):
    i_b = tl.program_id(0)
    cd = tl.program_id(1) * BD + tl.arange(0, BD)
    ct = tl.program_id(2) * BT + tl.arange(0, BT)
    md = cd < D
    mt = ct < T
    xrow = i_b.to(tl.int64) * D * T
    dx = tl.zeros([BD, BT], dtype=tl.float32)
    for i in tl.static_range(W):
        dst = ct + (W - 1 - i)          # the output that read x[t] through tap i
        ok = mt & (dst < T)
        if HAS_CU:
            ok = ok & (tl.load(st_ptr + dst, mask=ok, other=0) <= ct)
        dz = tl.load(dz_ptr + xrow + cd[:, None].to(tl.int64) * T + dst[None, :],
                     mask=md[:, None] & ok[None, :], other=0.0)
        wv = tl.load(w_ptr + cd * W + i, mask=md, other=0.0).to(tl.float32)
        dx += wv[:, None] * dz
    off = xrow + cd[:, None].to(tl.int64) * T + ct[None, :]
    tl.store(dx_ptr + off, dx.to(dx_ptr.dtype.element_ty), mask=md[:, None] & mt[None, :])


def _tiles(D, T):
    BD = min(32, triton.next_power_of_2(max(D, 1)))
    BT = min(64, max(16, triton.next_power_of_2(max(T, 1))))
    return BD, BT


# Launch options of the three kernels: 8 elements of a [BD, BT] tile per thread and a register
# budget of 128. Compiled for sm_80 / sm_90 (Triton 3.6 and 3.9): 32 elements per thread (the old
# [32, 128] tile on 4 warps) spill 16-80 B at 255 registers; at 8 or 16 per thread ptxas on its
# own stops at 64 registers in some fp16 variants and spills 32-136 B; with ``maxnreg=128`` none
# spills.
_MAXNREG = 128


def _launch_opts(BD, BT):
    return {"num_warps": max(1, min(8, BD * BT // 256)), "maxnreg": _MAXNREG}


def _starts(cu, T, device):
    """Per position, the position its sequence starts at (int32 [T])."""
    cu = cu.to(device=device, dtype=torch.long)
    return torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1], output_size=T).to(torch.int32)


class _CausalConv1d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, silu, cu_seqlens):
        B, D, T = x.shape
        W = weight.shape[1]
        xc, wc = x.contiguous(), weight.contiguous()
        bc = bias.contiguous() if bias is not None else None
        st = _starts(cu_seqlens, T, x.device) if cu_seqlens is not None else None
        y = _alloc.empty(B, D, T, dtype=x.dtype, device=x.device)
        BD, BT = _tiles(D, T)
        if y.numel():
            conv_fwd_kernel[(B, triton.cdiv(D, BD), triton.cdiv(T, BT))](
                xc, wc, bc if bc is not None else wc, st if st is not None else wc, y, D, T, W=W, BD=BD, BT=BT,
                HAS_BIAS=bc is not None, HAS_CU=st is not None, SILU=silu, **_launch_opts(BD, BT))
        ctx.save_for_backward(xc, wc, bc, st)
        ctx.silu = silu
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y

    @staticmethod
    def backward(ctx, dy):
        xc, wc, bc, st = ctx.saved_tensors
        return (*_backward(dy, xc, wc, bc, st, ctx.silu, ctx.bias_dtype), None, None)


def _backward(dy, xc, wc, bc, st, silu, bias_dtype):
    B, D, T = xc.shape
    W = wc.shape[1]
    BD, BT = _tiles(D, T)
    n_t = triton.cdiv(T, BT)
    dy = dy.contiguous()
    dx = _alloc.empty(B, D, T, dtype=xc.dtype, device=xc.device)
    dz = _alloc.empty(B, D, T, dtype=torch.float32, device=xc.device)
    dwp = _alloc.empty(B * n_t, D, W, dtype=torch.float32, device=xc.device)
    dbp = _alloc.empty(B * n_t, D, dtype=torch.float32, device=xc.device)
    if dx.numel():
        grid = (B, triton.cdiv(D, BD), n_t)
        dummy = wc
        conv_dz_kernel[grid](xc, wc, bc if bc is not None else dummy, st if st is not None else dummy, dy, dz,
                             dwp, dbp, D, T, n_t, W=W, BD=BD, BT=BT, HAS_BIAS=bc is not None,
                             HAS_CU=st is not None, SILU=silu, **_launch_opts(BD, BT))
        conv_dx_kernel[grid](wc, st if st is not None else dummy, dz, dx, D, T, W=W, BD=BD, BT=BT,
                             HAS_CU=st is not None, **_launch_opts(BD, BT))
        dw = dwp.sum(0).to(wc.dtype)
        db = dbp.sum(0).to(bias_dtype) if bc is not None else None
    else:
        dw = torch.zeros_like(wc)
        db = torch.zeros_like(bc) if bc is not None else None
    return dx, dw, db


def causal_conv1d_backward(dy, x, weight, bias, activation, cu_seqlens):
    """dy ``[B, D, T]`` -> (dx, dweight, dbias or None) of :func:`causal_conv1d`, from its inputs."""
    st = _starts(cu_seqlens, x.shape[2], x.device) if cu_seqlens is not None else None
    return _backward(dy, x.contiguous(), weight.contiguous(), bias.contiguous() if bias is not None else None, st,
                     activation == "silu", bias.dtype if bias is not None else None)


def causal_conv1d(x, weight, bias, activation, cu_seqlens):
    """x ``[B, D, T]``, weight ``[D, W]``, bias ``[D]`` or None, activation None or "silu",
    cu_seqlens ``[N + 1]`` int (B == 1) or None -> y ``[B, D, T]`` in x.dtype (differentiable)."""
    return _CausalConv1d.apply(x, weight, bias, activation == "silu", cu_seqlens)
