"""Triton kernels and autograd Functions of the gated linear units, ``act(gate) * up``.

``act`` is the ``ACT`` constexpr (:data:`twinkle_kernels._activations.CODE`): 0 SiLU, 1 exact
GELU (``erf``), 2 GELU's tanh approximation, written as ``g * sigmoid(2 z)``
(``0.5 (1 + tanh(z)) == sigmoid(2 z)``: one ``exp``, no libdevice ``tanh``). One compiled kernel
per activation, no per-element branch.

Both layouts share one pair of row kernels that read ``gate`` and ``up`` through their
own row strides: for the packed Megatron layout ``x: [M, 2n]`` they are the two column
halves of x (no copy), and the backward writes ``dgate`` / ``dup`` into the two halves
of one ``[M, 2n]`` gradient. Math in fp32, outputs in the input dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _alloc
from .._activations import CODE
from .._triton_utils import next_pow2, num_warps, on_device, rows

_MAX_BLOCK_N = 1024
_TILE = 2048

# (globals a kernel reads must be constexpr)
_TANH_C0 = tl.constexpr(1.5957691216057308)   # 2 * sqrt(2 / pi)
_TANH_C1 = tl.constexpr(0.071354816272919)    # 2 * sqrt(2 / pi) * 0.044715
_INV_SQRT2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


@triton.jit
def _act(g, ACT: tl.constexpr):
    """act(g) on fp32 g."""
    if ACT == 0:
        a = g / (1.0 + tl.exp(-g))
    elif ACT == 1:
        a = 0.5 * g * (1.0 + tl.erf(g * _INV_SQRT2))
    else:
        a = g / (1.0 + tl.exp(-g * (_TANH_C0 + _TANH_C1 * g * g)))
    return a


@triton.jit
def _act_grad(g, ACT: tl.constexpr):
    """(act(g), act'(g)) on fp32 g."""
    if ACT == 0:
        s = 1.0 / (1.0 + tl.exp(-g))
        a = g * s
        da = s * (1.0 + g * (1.0 - s))             # d silu(g)/dg
    elif ACT == 1:
        cdf = 0.5 * (1.0 + tl.erf(g * _INV_SQRT2))
        a = g * cdf
        da = cdf + g * _INV_SQRT_2PI * tl.exp(-0.5 * g * g)
    else:
        s = 1.0 / (1.0 + tl.exp(-g * (_TANH_C0 + _TANH_C1 * g * g)))
        a = g * s
        da = s + a * (1.0 - s) * (_TANH_C0 + 3.0 * _TANH_C1 * g * g)
    return a, da


@triton.jit(do_not_specialize=["M"])  # row counts vary per batch: one compile
def _swiglu_fwd_kernel(G, U, Y, M, N, stride_g, stride_u, stride_y,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ACT: tl.constexpr):
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (r < M)[:, None] & (c < N)[None, :]
    r64 = r.to(tl.int64)[:, None]
    g = tl.load(G + r64 * stride_g + c[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + r64 * stride_u + c[None, :], mask=mask, other=0.0).to(tl.float32)
    y = _act(g, ACT) * u
    tl.store(Y + r64 * stride_y + c[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _swiglu_bwd_kernel(DY, G, U, DG, DU, M, N, stride_dy, stride_g, stride_u, stride_dg, stride_du,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ACT: tl.constexpr):
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (r < M)[:, None] & (c < N)[None, :]
    r64 = r.to(tl.int64)[:, None]
    dy = tl.load(DY + r64 * stride_dy + c[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + r64 * stride_g + c[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + r64 * stride_u + c[None, :], mask=mask, other=0.0).to(tl.float32)
    a, da = _act_grad(g, ACT)
    dg = dy * u * da
    du = dy * a
    tl.store(DG + r64 * stride_dg + c[None, :], dg.to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + r64 * stride_du + c[None, :], du.to(DU.dtype.element_ty), mask=mask)


def _grid(m: int, n: int):
    block_n = min(next_pow2(n), _MAX_BLOCK_N)
    block_m = max(1, min(_TILE // block_n, next_pow2(m)))
    return (triton.cdiv(m, block_m), triton.cdiv(n, block_n)), block_m, block_n


def _forward(g2: torch.Tensor, u2: torch.Tensor, activation: str) -> torch.Tensor:
    m, n = g2.shape
    y = _alloc.empty(m, n, dtype=g2.dtype, device=g2.device)
    if m and n:
        grid, bm, bn = _grid(m, n)
        with on_device(g2):
            _swiglu_fwd_kernel[grid](g2, u2, y, m, n, g2.stride(0), u2.stride(0), y.stride(0),
                                     BLOCK_M=bm, BLOCK_N=bn, ACT=CODE[activation],
                                     num_warps=num_warps(bm * bn))
    return y


def _backward(dy2, g2, u2, dg, du, activation: str) -> None:
    m, n = g2.shape
    if m and n:
        grid, bm, bn = _grid(m, n)
        with on_device(g2):
            _swiglu_bwd_kernel[grid](dy2, g2, u2, dg, du, m, n, dy2.stride(0), g2.stride(0), u2.stride(0),
                                     dg.stride(0), du.stride(0), BLOCK_M=bm, BLOCK_N=bn,
                                     ACT=CODE[activation], num_warps=num_warps(bm * bn))


def swiglu_backward(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str = "silu"):
    """gate, up, dy: ``[..., I]`` -> (dgate, dup) in gate's shape and dtype."""
    g2, u2 = rows(gate), rows(up)
    dg, du = _alloc.empty_like(g2), _alloc.empty_like(u2)
    _backward(rows(dy), g2, u2, dg, du, activation)
    return dg.view(gate.shape), du.view(gate.shape)


def swiglu_packed_backward(dy: torch.Tensor, x: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """x: ``[..., 2n]``, dy: ``[..., n]`` -> dx in x's shape and dtype."""
    x2 = rows(x)
    n = x2.shape[1] // 2
    dx = _alloc.empty(x2.shape[0], 2 * n, dtype=x2.dtype, device=x2.device)
    _backward(rows(dy), x2[:, :n], x2[:, n:], dx[:, :n], dx[:, n:], activation)
    return dx.view(x.shape)


class SwiGLUFunction(torch.autograd.Function):
    """gate, up: ``[..., I]`` -> ``[..., I]``."""

    @staticmethod
    def forward(ctx, gate, up, activation):
        g2, u2 = rows(gate), rows(up)
        ctx.save_for_backward(g2, u2)
        ctx.shape, ctx.activation = gate.shape, activation
        return _forward(g2, u2, activation).view(gate.shape)

    @staticmethod
    def backward(ctx, dy):
        g2, u2 = ctx.saved_tensors
        dg, du = swiglu_backward(dy, g2, u2, ctx.activation)
        return dg.view(ctx.shape), du.view(ctx.shape), None


class SwiGLUPackedFunction(torch.autograd.Function):
    """x: ``[..., 2n]`` (gate half first) -> ``[..., n]``."""

    @staticmethod
    def forward(ctx, x, activation):
        x2 = rows(x)
        n = x2.shape[1] // 2
        ctx.save_for_backward(x2)
        ctx.shape, ctx.activation = x.shape, activation
        return _forward(x2[:, :n], x2[:, n:], activation).view(x.shape[:-1] + (n,))

    @staticmethod
    def backward(ctx, dy):
        (x2,) = ctx.saved_tensors
        return swiglu_packed_backward(dy, x2, ctx.activation).view(ctx.shape), None


def swiglu(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """gate, up: ``[..., I]`` same shape and dtype; returns ``act(gate) * up`` in that dtype."""
    return SwiGLUFunction.apply(gate, up, activation)


def swiglu_packed(x: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """x: ``[..., 2n]``; returns ``act(x[..., :n]) * x[..., n:]`` as ``[..., n]``."""
    return SwiGLUPackedFunction.apply(x, activation)
