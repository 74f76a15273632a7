"""The LoRA delta of several adapters over one batch of tokens, as grouped matmuls.

Each token carries the index of the adapter its row belongs to (``groups``, -1: no adapter on this
layer). The tokens are permuted into adapter segments, ``twinkle_kernels.grouped_matmul`` runs
every adapter's ``A`` then (after the layer's tensor-parallel communication, in token order) its
``B`` in one call each, and the result is put back in token order. Ranks differ between adapters:
the factors are zero-padded to the largest, which is exact (the padded columns of ``h`` are 0).

:func:`grouped_rows_matmul` is the primitive (``y[i] = x[i] @ w[groups[i]]``),
:func:`grouped_rows_matmul_reference` its per-adapter loop, :func:`stack_factors` the padded
``[G, in, R]`` / ``[G, R, out]`` weights of a list of adapters.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch


def _check(x: torch.Tensor, groups: torch.Tensor, w: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [N, K], got shape {tuple(x.shape)}")
    if w.dim() != 3 or w.shape[1] != x.shape[1]:
        raise ValueError(f"w must be [G, K={x.shape[1]}, M], got shape {tuple(w.shape)}")
    if groups.shape != (x.shape[0],) or groups.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"groups must be an int [N={x.shape[0]}] tensor, got {groups.dtype} {tuple(groups.shape)}")


def sort_by_group(groups: torch.Tensor, num_groups: int):
    """(row order that sorts the rows of groups 0.. by group, int32 cumulative segment ends)."""
    g = groups.long()
    order = torch.argsort(g, stable=True)
    counts = torch.bincount(g + 1, minlength=num_groups + 1)
    # the rows of group -1 sort first and get no delta
    return order[int(counts[0]):], torch.cumsum(counts[1:], 0).to(torch.int32)


class _GroupedRows(torch.autograd.Function):
    """Saves ``x`` itself (usually the layer input, alive anyway) rather than its permuted copy;
    the backward permutes again and runs the grouped matmul's own backward."""

    @staticmethod
    def forward(ctx, x, w, order, offsets, backend):
        import twinkle_kernels as tk
        ctx.save_for_backward(x, w, order, offsets)
        ctx.backend = backend
        with torch.no_grad():
            y = tk.grouped_matmul(x.index_select(0, order), w, offsets, backend=backend)
            return x.new_zeros(x.shape[0], w.shape[2]).index_copy_(0, order, y)

    @staticmethod
    def backward(ctx, dy):
        import twinkle_kernels as tk
        x, w, order, offsets = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[:2]
        with torch.enable_grad():
            xp = x.detach().index_select(0, order).requires_grad_(need_x)
            wd = w.detach().requires_grad_(need_w)
            y = tk.grouped_matmul(xp, wd, offsets, backend=ctx.backend)
            wanted = [t for t, need in ((xp, need_x), (wd, need_w)) if need]
            grads = list(torch.autograd.grad(y, wanted, dy.index_select(0, order).to(y.dtype)))
        dx = x.new_zeros(x.shape).index_copy_(0, order, grads.pop(0)) if need_x else None
        dw = grads.pop(0) if need_w else None
        return dx, dw, None, None, None


def grouped_rows_matmul(x: torch.Tensor, groups: torch.Tensor, w: torch.Tensor, *,
                        segments: Optional[tuple] = None, backend: Optional[str] = None) -> torch.Tensor:
    """``y[i] = x[i] @ w[groups[i]]``, 0 where ``groups[i] == -1``.

    x: ``[N, K]``; groups: int ``[N]`` in ``-1 .. G-1`` (any order); w: ``[G, K, M]`` in x's dtype.
    Returns ``[N, M]`` in x's dtype; differentiable in ``x`` and ``w`` (a group with no rows gets a
    zero gradient). One ``twinkle_kernels.grouped_matmul`` over the rows sorted by group
    (``backend`` is its backend) forward, and its backward (the permuted rows recomputed, not
    kept). ``segments``: :func:`sort_by_group` of ``groups``, when the caller has them already."""
    _check(x, groups, w)
    order, offsets = segments if segments is not None else sort_by_group(groups, w.shape[0])
    return _GroupedRows.apply(x, w, order, offsets.to(x.device), backend)


def grouped_rows_matmul_reference(x: torch.Tensor, groups: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """:func:`grouped_rows_matmul` as a loop over groups (the ground truth it is tested against)."""
    _check(x, groups, w)
    y = x.new_zeros(x.shape[0], w.shape[2])
    for e in range(w.shape[0]):
        rows = (groups == e).nonzero().reshape(-1)
        y = y.index_copy(0, rows, x[rows] @ w[e])
    return y


def stack_factors(factors: Sequence[Tuple[torch.Tensor, torch.Tensor]]):
    """``[(A_g [R_g, in], B_g [out, R_g])]`` -> ``(w_a [G, in, R], w_b [G, R, out])``, ``R = max R_g``,
    zero-padded (differentiable: each adapter's gradient flows back to its own factors)."""
    width = max(a.shape[0] for a, _ in factors)
    pad = torch.nn.functional.pad
    w_a = torch.stack([(a if a.shape[0] == width else pad(a, (0, 0, 0, width - a.shape[0]))).t() for a, _ in factors])
    w_b = torch.stack([(b if b.shape[1] == width else pad(b, (0, width - b.shape[1]))).t() for _, b in factors])
    return w_a, w_b


def lora_delta_reference(x: torch.Tensor, groups: torch.Tensor, factors, scalings) -> torch.Tensor:
    """The delta of several adapters, one plain LoRA per group: ``y[i] = s_g * B_g A_g x[i]``,
    ``g = groups[i]`` (0 where -1). x ``[N, in]``; factors ``[(A_g [R_g, in], B_g [out, R_g])]``."""
    y = x.new_zeros(x.shape[0], factors[0][1].shape[0])
    for e, ((a, b), s) in enumerate(zip(factors, scalings)):
        rows = (groups == e).nonzero().reshape(-1)
        y = y.index_copy(0, rows, s * (x[rows] @ a.t() @ b.t()))
    return y


def lora_delta(x: torch.Tensor, groups: torch.Tensor, factors, scalings, *, backend: Optional[str] = None):
    """:func:`lora_delta_reference` as two grouped matmuls (no communication: one process, or a
    layer whose TP communication the caller does between the two, see :mod:`.mixed`)."""
    w_a, w_b = stack_factors(factors)
    scale = torch.tensor(list(scalings) + [0.0], dtype=x.dtype, device=x.device)
    h = grouped_rows_matmul(x, groups, w_a.to(x.dtype), backend=backend)
    return grouped_rows_matmul(h, groups, w_b.to(x.dtype), backend=backend) * scale[groups.long()][:, None]
