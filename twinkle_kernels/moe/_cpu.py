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
    """Measured rule (2-core Xeon with AMX, torch 2.13): never.

    ``torch._grouped_mm`` exists on CPU in torch 2.13 and is correct, but at the
    benchmark shapes (S = 32768 rows, E = 64, K, N in {512, 1024}) it ran slower than the
    C++ op in every dtype: fp32 ~2.8x slower (it does not reach MKL's sgemm speed),
    bf16 0.6-0.7 s against ~0.35 s for the per-tile oneDNN calls; its backward also
    rejects expanded (stride-0) gradients. Kept as a named rule so a future torch that
    wins can be switched on here, with the measurement, in one place.
    """
    return False


def _dw_like(w: torch.Tensor) -> torch.Tensor:
    # Give dw the memory layout of w: for ``proj.transpose(1, 2)`` views the gradient is then a
    # plain contiguous [E, N, K] tensor for the parameter, with no copy in autograd.
    e, k, n = w.shape
    if not w.is_contiguous() and w.transpose(1, 2).is_contiguous():
        return _alloc.empty(e, n, k, dtype=w.dtype, device=w.device).transpose(1, 2)
    return _alloc.empty(e, k, n, dtype=w.dtype, device=w.device)


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
        x, w, offs = (t.detach() for t in ctx.saved_tensors)
        dy = dy.detach().to(x.dtype).contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = _alloc.empty(x.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
            _cpu_ext.ops().grouped_mm_fwd(dy, w.transpose(1, 2), offs, dx)
        if ctx.needs_input_grad[1]:
            dw = _dw_like(w)
            _cpu_ext.ops().grouped_mm_dw(x, dy, offs, dw)
        return dx, dw, None


def grouped_matmul(x, w, offsets):
    return GroupedMatmulFunction.apply(x, w, offsets)
