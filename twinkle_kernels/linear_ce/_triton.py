"""Triton engine of the fused linear cross-entropy: chunk GEMMs by ``torch.mm`` (cuBLAS), and one
fused online-softmax kernel per pass over a chunk's fp32 logits (one program per row, looping
over the vocabulary in blocks): statistics in the forward, the logits' gradient in place after.

The kernels use no libdevice (tanh is written with exp) and take float scalars as plain
arguments, so they also run in the interpreter (``TRITON_INTERPRET=1``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton_utils import next_pow2, num_warps, on_device, tuned_for_gpu
from ._chunked import ChunkLoop, Params


@triton.jit
def _tanh(u):
    # 1 - 2 / (exp(2u) + 1): exp overflowing to inf gives 1, underflowing to 0 gives -1.
    return 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)


@triton.jit
def _stats_kernel(X, stride_x, Y, LSE, LOSS, LOGP, ENT, V, VT, ignore_index, inv_t, cap, inv_cap, eps,
                  HAS_CAP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    y = tl.load(Y + row)
    base = X + row.to(tl.int64) * stride_x
    m = float("-inf")
    s = 0.0
    t = 0.0
    sz = 0.0
    zy = 0.0
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < V
        z = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32) * inv_t
        if HAS_CAP:
            z = cap * _tanh(z * inv_cap)
        m_new = tl.maximum(m, tl.max(tl.where(mask, z, float("-inf")), axis=0))
        e = tl.where(mask, tl.exp(z - m_new), 0.0)
        alpha = tl.exp(m - m_new)
        s = s * alpha + tl.sum(e, axis=0)
        t = t * alpha + tl.sum(e * z, axis=0)
        sz += tl.sum(tl.where(mask, z, 0.0), axis=0)
        zy += tl.sum(tl.where(offs == y, z, 0.0), axis=0)
        m = m_new
    lse = m + tl.log(s)
    valid = y != ignore_index
    tl.store(LSE + row, tl.where(valid, lse, 0.0))
    tl.store(LOSS + row, tl.where(valid, lse - (1.0 - eps) * zy - eps * sz / VT, 0.0))
    tl.store(LOGP + row, tl.where(valid, zy - lse, 0.0))
    tl.store(ENT + row, tl.where(valid, lse - t / s, 0.0))


@triton.jit
def _grad_kernel(X, stride_x, Y, LSE, ENT, A, B, C, V, VT, ignore_index, inv_t, cap, inv_cap, eps,
                 HAS_CAP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    y = tl.load(Y + row)
    valid = y != ignore_index
    base = X + row.to(tl.int64) * stride_x
    lse = tl.load(LSE + row)
    ent = tl.load(ENT + row)
    a = tl.load(A + row)
    b = tl.load(B + row)
    c = tl.load(C + row)
    k0 = a - b - c * (ent - lse)
    konst = -a * eps / VT
    d1 = b - a * (1.0 - eps)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < V
        z = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32) * inv_t
        if HAS_CAP:
            z = cap * _tanh(z * inv_cap)
        p = tl.exp(z - lse)
        d = p * (k0 - c * z) + konst + tl.where(offs == y, d1, 0.0)
        if HAS_CAP:
            r = z * inv_cap
            d = d * (1.0 - r * r)
        # Ignored rows: lse is 0 there and exp(z) may overflow, so the row is zeroed outright.
        d = tl.where(valid, d * inv_t, 0.0)
        tl.store(base + offs, d, mask=mask)


def _launch_args(x: torch.Tensor, p: Params):
    V = x.shape[1]
    block = min(next_pow2(V), 4096 if tuned_for_gpu(x) else 1024)
    cap = float(p.softcap)
    inv_cap = 1.0 / cap if cap > 0 else 0.0
    return V, p.vocab_total or V, block, (float(1.0 / p.temperature), cap, inv_cap, float(p.label_smoothing)), cap > 0


class TritonRows:
    """Per-row kernels of :class:`._chunked.ChunkLoop` for one contiguous fp32 chunk [C, V]."""

    def stats(self, x, y, p: Params, lse, loss, logp, ent):
        C = x.shape[0]
        if C == 0:
            return
        V, VT, block, scal, has_cap = _launch_args(x, p)
        with on_device(x):
            _stats_kernel[(C,)](x, x.stride(0), y, lse, loss, logp, ent, V, VT, p.ignore_index, *scal,
                                HAS_CAP=has_cap, BLOCK=block, num_warps=num_warps(block))

    def grad(self, x, y, lse, ent, a, b, c, p: Params):
        C = x.shape[0]
        if C == 0:
            return
        V, VT, block, scal, has_cap = _launch_args(x, p)
        a, b, c = (t.contiguous() for t in (a, b, c))
        with on_device(x):
            _grad_kernel[(C,)](x, x.stride(0), y, lse, ent, a, b, c, V, VT, p.ignore_index, *scal,
                               HAS_CAP=has_cap, BLOCK=block, num_warps=num_warps(block))


ENGINE = ChunkLoop(TritonRows())
