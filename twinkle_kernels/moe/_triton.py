"""Grouped matmul in Triton: one launch for all experts, forward and backward.

Forward and dx use one kernel: a 2-D grid over (row tiles of all groups, column tiles).
The row tiles are listed on the host from the offsets (which the public function has
already copied to check them), each tile with its expert and first row, so a program
finds its expert with one load and never straddles two groups; an empty group has no
tile. dx is the same kernel on ``w.transpose(1, 2)`` (strides, no copy). dw is a grid over
(expert, K tile, N tile), each program looping over the rows of its group:
``dw[e] = x_g^T @ dy_g``; an empty group stores zeros.

Tiles come from :func:`gemm_tiles` (a small table keyed on dtype and shape): bf16/fp16
operands go to the tensor cores as they are (``tl.dot`` on 16-bit tiles of at least
64 x 64 x 64, fp32 accumulation); fp32 operands use ``input_precision="ieee"`` (TF32 would
miss the fp32 tolerance). Each configuration compiles for sm_80 and sm_90 without local
memory (stack) and within both archs' shared memory.

``emulate_bf16=True`` (fp32 inputs only) runs the bf16 path's algorithm in fp32: every tile
loaded is rounded to bf16 (8-bit mantissa, round to nearest even, in integer arithmetic),
products and sums are fp32 as on the tensor cores, and outputs are rounded to bf16 again. The
Triton interpreter computes bf16 ``tl.dot`` wrongly, so this is how CI checks the bf16 tiles
and their bookkeeping against float64; a GPU runs the real bf16 path.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import _alloc


@triton.jit
def _round_bf16(x):
    """fp32 -> the nearest bfloat16 value (ties to even), still fp32. (Inf / NaN are not kept.)"""
    u = x.to(tl.uint32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.to(tl.float32, bitcast=True)


@triton.jit
def _gmm_rows_kernel(x_ptr, w_ptr, y_ptr, tile_expert_ptr, tile_row_ptr, ends_ptr,
                     N, K, sxm, sxk, swe, swk, swn, sym, syn,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PRECISION: tl.constexpr, EMULATE_BF16: tl.constexpr):
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
        if EMULATE_BF16:
            a = _round_bf16(a)
            b = _round_bf16(b)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if EMULATE_BF16:
        acc = _round_bf16(acc)
    tl.store(y_ptr + rows[:, None] * sym + cols[None, :] * syn, acc.to(y_ptr.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _gmm_dw_kernel(x_ptr, dy_ptr, dw_ptr, starts_ptr, ends_ptr,
                   K, N, sxm, sxk, sdm, sdn, swe, swk, swn,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                   PRECISION: tl.constexpr, EMULATE_BF16: tl.constexpr):
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
        if EMULATE_BF16:
            xt = _round_bf16(xt)
            g = _round_bf16(g)
        acc = tl.dot(xt, g, acc, input_precision=PRECISION)
    if EMULATE_BF16:
        acc = _round_bf16(acc)
    tl.store(dw_ptr + e.to(tl.int64) * swe + ks[:, None] * swk + cols[None, :] * swn,
             acc.to(dw_ptr.dtype.element_ty), mask=kmask[:, None] & cmask[None, :])


class GemmTiles(NamedTuple):
    """One launch configuration. For the row kernel: a ``[block_m, block_n]`` output tile and
    ``block_k`` of the reduction per step. For the dw kernel: a ``[block_k, block_n]`` tile of
    ``dw[e]`` and ``block_m`` rows of the group per step."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    precision: str
    maxnreg: int = 0     # 0: ptxas's own register budget


# The table. 16-bit operands: tensor-core tiles, 128 x 128 once groups are big enough to fill
# them (fewer, fuller tiles), else 64-row tiles (a group of 65 rows wastes half a 128-row tile).
# 3-4 stages keep the shared memory at <= 96 KiB (sm_80 allows 163 KiB). fp32 (ieee) runs on the
# FMA units: 64 x 64 x 32 keeps the accumulator and operands in registers.
def gemm_tiles(dtype: torch.dtype, rows_per_group: float, n: int, emulate_bf16: bool = False) -> GemmTiles:
    """Tiles of the row kernel (forward and dx) for ``[M, K] @ [K, n]`` per group, with
    ``rows_per_group`` the mean rows of a non-empty group."""
    if dtype == torch.float32 and not emulate_bf16:
        return GemmTiles(64, 64, 32, 4, 3, "ieee")
    if rows_per_group >= 128 and n >= 128:
        t = GemmTiles(128, 128, 64, 8, 3, "tf32")  # the precision is ignored for 16-bit operands
    elif n >= 128:
        t = GemmTiles(64, 128, 64, 4, 4, "tf32")
    else:
        t = GemmTiles(64, 64, 64, 4, 4, "tf32")
    return _emulated(t, t.block_k // 2) if emulate_bf16 else t


def dw_tiles(dtype: torch.dtype, k: int, n: int, emulate_bf16: bool = False) -> GemmTiles:
    """Tiles of the dw kernel for ``dw[e]`` of shape ``[k, n]``."""
    if dtype == torch.float32 and not emulate_bf16:
        return GemmTiles(32, 64, 64, 4, 3, "ieee")
    t = GemmTiles(64, 128, 128, 8, 3, "tf32") if k >= 128 and n >= 128 else GemmTiles(64, 64, 64, 4, 4, "tf32")
    return _emulated(t._replace(block_m=t.block_m // 2)) if emulate_bf16 else t


def _emulated(t: GemmTiles, block_k: int = 0) -> GemmTiles:
    # The same output tiles in fp32 (ieee): twice the bytes per stage and no tensor cores, so on a
    # GPU (where only tests run it) 1 stage keeps it within sm_80's shared memory, and 16 warps, half
    # the reduction step and an explicit register budget (ptxas alone stops at 32 on sm_80 and
    # spills kilobytes) keep the fp32 operands in registers.
    return t._replace(block_k=block_k or t.block_k, num_warps=16, num_stages=1, precision="ieee", maxnreg=128)


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


def _maxnreg(cfg: GemmTiles) -> dict:
    return {"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}


def _check_emulation(x, emulate_bf16: bool) -> None:
    if emulate_bf16 and x.dtype != torch.float32:
        raise TypeError(f"emulate_bf16 runs on float32 inputs (rounded to bf16 inside), got {x.dtype}")


def _gmm(x, w, ends, ends_dev, emulate_bf16=False):
    m, k = x.shape
    n = w.shape[2]
    y = _alloc.empty(m, n, dtype=x.dtype, device=x.device)
    groups = sum(1 for a, b in zip([0] + list(ends[:-1]), ends) if b > a)
    cfg = gemm_tiles(x.dtype, m / max(groups, 1), n, emulate_bf16)
    tile_expert, tile_row = _tiles(ends, cfg.block_m, x.device)
    if tile_expert.numel() == 0 or n == 0:
        return y
    grid = (tile_expert.numel(), triton.cdiv(n, cfg.block_n))
    _gmm_rows_kernel[grid](x, w, y, tile_expert, tile_row, ends_dev, n, k,
                           x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2),
                           y.stride(0), y.stride(1), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                           BLOCK_K=cfg.block_k, PRECISION=cfg.precision, EMULATE_BF16=emulate_bf16,
                           num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_maxnreg(cfg))
    return y


def _gmm_dw(x, dy, w, ends_dev, starts_dev, emulate_bf16=False):
    e, k, n = w.shape
    dw = _alloc.empty_like_weight(w)
    if k == 0 or n == 0:
        return dw
    cfg = dw_tiles(x.dtype, k, n, emulate_bf16)
    grid = (e, triton.cdiv(k, cfg.block_k), triton.cdiv(n, cfg.block_n))
    _gmm_dw_kernel[grid](x, dy, dw, starts_dev, ends_dev, k, n,
                         x.stride(0), x.stride(1), dy.stride(0), dy.stride(1),
                         dw.stride(0), dw.stride(1), dw.stride(2),
                         BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, BLOCK_N=cfg.block_n,
                         PRECISION=cfg.precision, EMULATE_BF16=emulate_bf16,
                         num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_maxnreg(cfg))
    return dw


def grouped_matmul_backward(dy, x, w, offsets, need_dx=True, need_dw=True, ends=None, emulate_bf16=False):
    """dy ``[M, N]`` -> (dx ``[M, K]`` or None, dw ``[E, K, N]`` or None); ``ends``: offsets as a list
    (read from the device when not given)."""
    _check_emulation(x, emulate_bf16)
    ends = offsets.tolist() if ends is None else ends
    ends_dev = offsets.to(device=x.device, dtype=torch.int32).contiguous()
    dy = dy.to(x.dtype).contiguous()
    dx = dw = None
    if need_dx:
        dx = _gmm(dy, w.transpose(1, 2), ends, ends_dev, emulate_bf16)
    if need_dw:
        starts = torch.cat([ends_dev.new_zeros(1), ends_dev[:-1]])
        dw = _gmm_dw(x, dy, w, ends_dev, starts, emulate_bf16)
    return dx, dw


class GroupedMatmulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offsets, emulate_bf16):
        ends = offsets.tolist()
        ends_dev = offsets.to(device=x.device, dtype=torch.int32).contiguous()
        ctx.save_for_backward(x, w, ends_dev)
        ctx.ends, ctx.emulate_bf16 = ends, emulate_bf16
        return _gmm(x, w, ends, ends_dev, emulate_bf16)

    @staticmethod
    def backward(ctx, dy):
        x, w, ends_dev = ctx.saved_tensors
        dx, dw = grouped_matmul_backward(dy, x, w, ends_dev, *ctx.needs_input_grad[:2], ends=ctx.ends,
                                         emulate_bf16=ctx.emulate_bf16)
        return dx, dw, None, None


def grouped_matmul(x, w, offsets, emulate_bf16: bool = False):
    """x ``[M, K]``, w ``[E, K, N]`` (same dtype), offsets int32 ``[E]`` -> ``[M, N]`` (differentiable).
    ``emulate_bf16``: fp32 x / w computed as the bf16 path computes (see the module docstring)."""
    _check_emulation(x, emulate_bf16)
    return GroupedMatmulFunction.apply(x, w, offsets, emulate_bf16)
