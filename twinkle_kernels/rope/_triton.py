"""Triton kernel and autograd Function of the rotary embedding (Hugging Face ``rotate_half``).

With ``x1, x2`` the two halves of the first ``R = cos.shape[-1]`` channels (and ``c1, c2``,
``s1, s2`` the halves of cos and sin):

    forward:   y1 = x1*c1 - x2*s1        y2 = x2*c2 + x1*s2
    backward: dx1 = dy1*c1 + dy2*s2     dx2 = dy2*c2 - dy1*s1

Channels ``R..D`` pass through (their gradient too). q and k are viewed as
``[P, H, Q, D]``: the dims before the head dim flattened into P, those after it into Q,
so cos / sin become ``[P, Q, R]`` (broadcast dims keep stride 0, no copy when a view
exists). One program handles one ``(p, q)`` position for all heads, loading cos / sin once.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import _alloc
from .._triton_utils import next_pow2, num_warps, on_device


@triton.jit(do_not_specialize=["H"])
def _rope_kernel(X, COS, SIN, Y, H, Q, D, HALF,
                 sx_p, sx_h, sx_q, sy_p, sy_h, sy_q, sc_p, sc_q, sc_r, ss_p, ss_q, ss_r,
                 BACKWARD: tl.constexpr, HAS_PASS: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr):
    pos = tl.program_id(0).to(tl.int64)
    p = pos // Q
    qi = pos % Q
    j = tl.arange(0, BLOCK_HALF)
    jm = j < HALF
    cb = COS + p * sc_p + qi * sc_q
    sb = SIN + p * ss_p + qi * ss_q
    c1 = tl.load(cb + j * sc_r, mask=jm, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cb + (j + HALF) * sc_r, mask=jm, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sb + j * ss_r, mask=jm, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sb + (j + HALF) * ss_r, mask=jm, other=0.0).to(tl.float32)[None, :]

    h = tl.arange(0, BLOCK_H).to(tl.int64)
    hm = h < H
    xb = X + p * sx_p + qi * sx_q + h[:, None] * sx_h
    yb = Y + p * sy_p + qi * sy_q + h[:, None] * sy_h
    m = hm[:, None] & jm[None, :]
    x1 = tl.load(xb + j[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(xb + (j + HALF)[None, :], mask=m, other=0.0).to(tl.float32)
    if BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(yb + j[None, :], y1.to(Y.dtype.element_ty), mask=m)
    tl.store(yb + (j + HALF)[None, :], y2.to(Y.dtype.element_ty), mask=m)
    if HAS_PASS:
        k = 2 * HALF + tl.arange(0, BLOCK_PASS)
        mp = hm[:, None] & (k < D)[None, :]
        xp = tl.load(xb + k[None, :], mask=mp, other=0.0)
        tl.store(yb + k[None, :], xp.to(Y.dtype.element_ty), mask=mp)


# An explicit register budget: left to itself, ptxas (Triton 3.6, sm_80 / sm_90) stops at 40
# registers in the fp16 backward with 8 heads and head_dim 256 and spills 24 B; with 128 allowed it
# takes 56 and none of the launches at model shapes spills.
_MAXNREG = 128


def _as_phqd(x: torch.Tensor, ud: int) -> torch.Tensor:
    """``x`` viewed as ``[P, H, Q, D]`` around its head dim ``ud``, unit stride on D."""
    p = math.prod(x.shape[:ud])
    q = math.prod(x.shape[ud + 1:-1])
    x4 = x.reshape(p, x.shape[ud], q, x.shape[-1])
    if x4.shape[-1] > 1 and x4.stride(-1) != 1:
        x4 = x4.contiguous()
    return x4


def _as_pqr(c: torch.Tensor, x_shape: torch.Size, ud: int) -> torch.Tensor:
    """cos / sin broadcast to x's positions, as ``[P, Q, R]`` (a view where one exists)."""
    r = c.shape[-1]
    # expanded over one head, not x's: x may have none (select(ud, 0) of 0 heads raises)
    ce = c.unsqueeze(ud).expand(x_shape[:ud] + (1,) + x_shape[ud + 1:-1] + (r,)).select(ud, 0)
    return ce.reshape(math.prod(x_shape[:ud]), math.prod(x_shape[ud + 1:-1]), r)


def _launch(x4: torch.Tensor, c3: torch.Tensor, s3: torch.Tensor, backward: bool) -> torch.Tensor:
    P, H, Q, D = x4.shape
    y4 = _alloc.empty(P, H, Q, D, dtype=x4.dtype, device=x4.device)
    if y4.numel() == 0:
        return y4
    R = c3.shape[-1]
    block_h, block_half, block_pass = next_pow2(H), next_pow2(R // 2), next_pow2(D - R)
    with on_device(x4):
        _rope_kernel[(P * Q,)](
            x4, c3, s3, y4, H, Q, D, R // 2,
            x4.stride(0), x4.stride(1), x4.stride(2), y4.stride(0), y4.stride(1), y4.stride(2),
            c3.stride(0), c3.stride(1), c3.stride(2), s3.stride(0), s3.stride(1), s3.stride(2),
            BACKWARD=backward, HAS_PASS=D > R,
            BLOCK_H=block_h, BLOCK_HALF=block_half, BLOCK_PASS=block_pass,
            num_warps=num_warps(block_h * block_half * 2), maxnreg=_MAXNREG)
    return y4


def apply_rotary_pos_emb_backward(dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ud: int):
    """The gradients of q and k (the op is linear in them: only cos / sin are needed); dq, dk in
    q's and k's shapes, cos / sin as the forward's."""
    return tuple(_launch(_as_phqd(dy, ud), _as_pqr(cos.detach(), dy.shape, ud), _as_pqr(sin.detach(), dy.shape, ud),
                         backward=True).view(dy.shape) for dy in (dq, dk))


class RotaryEmbeddingFunction(torch.autograd.Function):
    """q: ``[..., Hq, ..., D]``, k: ``[..., Hk, ..., D]`` (head dim at ``ud``); cos, sin: ``[..., R]``."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, ud):
        outs, saved = [], []
        for x in (q, k):
            x4 = _as_phqd(x, ud)
            c3, s3 = _as_pqr(cos, x.shape, ud), _as_pqr(sin, x.shape, ud)
            outs.append(_launch(x4, c3, s3, backward=False).view(x.shape))
            saved += [c3, s3]
        ctx.save_for_backward(*saved)
        ctx.ud, ctx.shapes = ud, (q.shape, k.shape)
        return outs[0], outs[1]

    @staticmethod
    def backward(ctx, dq, dk):
        cq, sq, ck, sk = ctx.saved_tensors
        grads = []
        for dy, shape, c3, s3 in ((dq, ctx.shapes[0], cq, sq), (dk, ctx.shapes[1], ck, sk)):
            grads.append(_launch(_as_phqd(dy, ctx.ud), c3, s3, backward=True).view(shape))
        return grads[0], grads[1], None, None, None


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int):
    """q, k: ``cos.dim() + 1`` dims, head dim at ``unsqueeze_dim`` (non-negative), same dtype;
    cos, sin: ``[..., R]``, R even, ``R <= D`` (no grad). Returns ``(q_embed, k_embed)``."""
    return RotaryEmbeddingFunction.apply(q, k, cos.detach(), sin.detach(), unsqueeze_dim)
