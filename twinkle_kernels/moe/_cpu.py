"""Grouped matmul on the C++ CPU backend (``csrc/moe/grouped_mm.cpp``).

Forward, dx and dw are each one C++ op over all experts (parallel over expert x tile).
``torch._grouped_mm`` is used instead where it measured faster on this CPU; see
:func:`_use_torch_grouped_mm` for the rule and ``benchmarks/results/moe_cpu_*.md`` for
the figures behind it.
"""
from __future__ import annotations

import torch

from .. import _alloc, _cpu_ext


def _use_torch_grouped_mm(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Measured rule (2-core Xeon with AMX, torch 2.13 CPU): never.

    ``torch._grouped_mm`` exists on CPU in torch 2.13 and is correct, but it lost to the
    C++ op in every measurement here. At S = 32768 rows, K = N = 1024, E = 64, measured in
    one run (s, medians): forward fp32 5.2 vs 2.7, bf16 1.8 vs 0.43; dw-shaped products
    fp32 6.0 vs 2.7, bf16 2.3 vs 1.0. At small shapes (M = 2048, K = N = 256, E = 16) it was
    ~15-50x slower. Its backward also rejects expanded (stride-0) gradients. The rule
    lives here so a future torch that wins can be switched on in one place, with the
    figures from ``benchmarks/scripts/moe_cpu.py`` (its second table times exactly this choice).
    """
    return False


def grouped_matmul_backward(dy, x, w, offsets, need_dx=True, need_dw=True):
    """dy ``[M, N]`` -> (dx ``[M, K]`` or None, dw in w's ``[E, K, N]`` layout or None)."""
    offs = offsets.to("cpu")
    x, w = x.detach(), w.detach()
    dy = dy.detach().to(x.dtype).contiguous()
    dx = dw = None
    if need_dx:
        dx = _alloc.empty(x.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
        _cpu_ext.ops().grouped_mm_fwd(dy, w.transpose(1, 2), offs, dx)
    if need_dw:
        dw = _alloc.empty_like_weight(w)
        _cpu_ext.ops().grouped_mm_dw(x, dy, offs, dw)
    return dx, dw


class GroupedMatmulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offsets):
        offs = offsets.to("cpu")
        ctx.save_for_backward(x, w, offs)
        x, w = x.detach(), w.detach()
        if _use_torch_grouped_mm(x, w):
            return torch._grouped_mm(x, w, offs=offs)
        y = _alloc.empty(x.shape[0], w.shape[2], dtype=x.dtype, device=x.device)
        _cpu_ext.ops().grouped_mm_fwd(x, w, offs, y)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, offs = ctx.saved_tensors
        dx, dw = grouped_matmul_backward(dy, x, w, offs, *ctx.needs_input_grad[:2])
        return dx, dw, None


def grouped_matmul(x, w, offsets):
    return GroupedMatmulFunction.apply(x, w, offsets)
