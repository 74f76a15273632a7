"""Grouped matmul in Triton: one launch for all experts, forward and backward.

Forward and dx use one kernel: a 2-D grid over (row tiles of all groups, column tiles).
The row tiles are listed on the host from the offsets (which the public function has
already copied to check them), each tile with its expert and first row, so a program
finds its expert with one load and never straddles two groups. dx is the same kernel on
``w.transpose(1, 2)`` (strides, no copy). dw is a grid over (expert, K tile, N tile), each
program looping over the rows of its group: ``dw[e] = x_g^T @ dy_g``; an empty group
stores zeros.

Accumulation is fp32. fp32 inputs use ``input_precision="ieee"`` (TF32 would miss the
fp32 tolerance); bf16/fp16 use the tensor cores. Runs under ``TRITON_INTERPRET=1`` in
fp32 (no autotune, no block pointers, plain masks).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _alloc, _dispatch


@triton.jit
def _gmm_rows_kernel(x_ptr, w_ptr, y_ptr, tile_expert_ptr, tile_row_ptr, ends_ptr,
                     N, K, sxm, sxk, swe, swk, swn, sym, syn,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
    r0 = tl.load(tile_row_ptr + pid_m).to(tl.int64)
    r_end = tl.load(ends_ptr + e).to(tl.int64)
    rows = r0 + tl.arange(0, BLOCK_M).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < r_end
    cmask = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        a = tl.load(x_ptr + rows[:, None] * sxm + ks[None, :] * sxk, mask=rmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(w_ptr + e * swe + ks[:, None] * swk + cols[None, :] * swn,
                    mask=kmask[:, None] & cmask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    tl.store(y_ptr + rows[:, None] * sym + cols[None, :] * syn, acc.to(y_ptr.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _gmm_dw_kernel(x_ptr, dy_ptr, dw_ptr, starts_ptr, ends_ptr,
                   K, N, sxm, sxk, sdm, sdn, swe, swk, swn,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                   PRECISION: tl.constexpr):
    e = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_n = tl.program_id(2)
    r_start = tl.load(starts_ptr + e)
    r_end = tl.load(ends_ptr + e)
    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kmask = ks < K
    cmask = cols < N
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for r0 in range(r_start, r_end, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M).to(tl.int64)
        rmask = rows < r_end
        xt = tl.load(x_ptr + ks[:, None] * sxk + rows[None, :] * sxm, mask=kmask[:, None] & rmask[None, :], other=0.0)
        g = tl.load(dy_ptr + rows[:, None] * sdm + cols[None, :] * sdn, mask=rmask[:, None] & cmask[None, :],
                    other=0.0)
        acc = tl.dot(xt, g, acc, input_precision=PRECISION)
    tl.store(dw_ptr + e.to(tl.int64) * swe + ks[:, None] * swk + cols[None, :] * swn,
             acc.to(dw_ptr.dtype.element_ty), mask=kmask[:, None] & cmask[None, :])


def _config(dtype: torch.dtype):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, precision)."""
    precision = "ieee" if dtype == torch.float32 else "tf32"  # "tf32" is ignored for 16-bit inputs
    if _dispatch.triton_interpret():
        return 32, 32, 32, 4, 1, precision
    if dtype == torch.float32:
        return 64, 64, 32, 4, 3, precision
    return 128, 128, 64, 8, 3, precision


def _tiles(ends, block_m: int, device):
    experts, rows = [], []
    start = 0
    for e, end in enumerate(ends):
        for r in range(start, end, block_m):
            experts.append(e)
            rows.append(r)
        start = end
    t = torch.tensor([experts, rows], dtype=torch.int32).to(device)
    return t[0], t[1]


def _gmm(x, w, ends, ends_dev):
    m, k = x.shape
    n = w.shape[2]
    y = _alloc.empty(m, n, dtype=x.dtype, device=x.device)
    bm, bn, bk, warps, stages, prec = _config(x.dtype)
    tile_expert, tile_row = _tiles(ends, bm, x.device)
    if tile_expert.numel() == 0 or n == 0:
        return y
    grid = (tile_expert.numel(), triton.cdiv(n, bn))
    _gmm_rows_kernel[grid](x, w, y, tile_expert, tile_row, ends_dev, n, k,
                           x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2),
                           y.stride(0), y.stride(1), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                           PRECISION=prec, num_warps=warps, num_stages=stages)
    return y


def _gmm_dw(x, dy, w, ends_dev, starts_dev):
    e, k, n = w.shape
    dw = _alloc.empty_like_weight(w)
    bm, bn, bk, warps, stages, prec = _config(x.dtype)
    if k == 0 or n == 0:
        return dw
    # Rows are the reduction here: step them by the forward's K block; K takes the row block.
    rows_step, block_k = bk, bm
    grid = (e, triton.cdiv(k, block_k), triton.cdiv(n, bn))
    _gmm_dw_kernel[grid](x, dy, dw, starts_dev, ends_dev, k, n,
                         x.stride(0), x.stride(1), dy.stride(0), dy.stride(1),
                         dw.stride(0), dw.stride(1), dw.stride(2),
                         BLOCK_M=rows_step, BLOCK_K=block_k, BLOCK_N=bn, PRECISION=prec,
                         num_warps=warps, num_stages=stages)
    return dw


def grouped_matmul_backward(dy, x, w, offsets, need_dx=True, need_dw=True, ends=None):
    """dy ``[M, N]`` -> (dx ``[M, K]`` or None, dw ``[E, K, N]`` or None); ``ends``: offsets as a list
    (read from the device when not given)."""
    ends = offsets.tolist() if ends is None else ends
    ends_dev = offsets.to(device=x.device, dtype=torch.int32).contiguous()
    dy = dy.to(x.dtype).contiguous()
    dx = dw = None
    if need_dx:
        dx = _gmm(dy, w.transpose(1, 2), ends, ends_dev)
    if need_dw:
        starts = torch.cat([ends_dev.new_zeros(1), ends_dev[:-1]])
        dw = _gmm_dw(x, dy, w, ends_dev, starts)
    return dx, dw


class GroupedMatmulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offsets):
        ends = offsets.tolist()
        ends_dev = offsets.to(device=x.device, dtype=torch.int32).contiguous()
        ctx.save_for_backward(x, w, ends_dev)
        ctx.ends = ends
        return _gmm(x, w, ends, ends_dev)

    @staticmethod
    def backward(ctx, dy):
        x, w, ends_dev = ctx.saved_tensors
        dx, dw = grouped_matmul_backward(dy, x, w, ends_dev, *ctx.needs_input_grad[:2], ends=ctx.ends)
        return dx, dw, None


def grouped_matmul(x, w, offsets):
    return GroupedMatmulFunction.apply(x, w, offsets)
