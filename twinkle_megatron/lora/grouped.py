"""The LoRA delta of several adapters over one batch of tokens, as grouped matmuls.

Each token carries the index of the adapter its row belongs to (``groups``, -1: no adapter on this
layer). The tokens are permuted into adapter segments, ``twinkle_kernels.grouped_matmul`` runs
every adapter's ``A`` then its ``B`` in one call each, and the result is put back in token order:
:func:`grouped_lora` does both between one permutation and one back; :func:`grouped_factor` does
one of them, for a layer whose tensor-parallel communication runs between the two (the tokens
are permuted again after it). Ranks differ between adapters: the factors are zero-padded to the
largest (:func:`stack_a` / :func:`stack_b`), which is exact (the padded columns of ``h`` are 0);
the scaling is folded into the stacked ``B``. The backward calls the grouped matmul's backward
kernels (``twinkle_kernels.grouped_matmul_backward``) and keeps only the layer input, the
``[N, R]`` rank-space activations and the adapters' parameters: the permuted rows and the stacked
factors are rebuilt there (:class:`Factors`), not kept for it.

:func:`lora_delta_reference` is the per-adapter loop of the whole delta (the ground truth the
grouped ops are tested against).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch


def sort_by_group(groups: torch.Tensor, num_groups: int):
    """(row order that sorts the rows of groups 0.. by group, int32 cumulative segment ends) of an
    int ``groups`` ``[N]`` in ``-1 .. num_groups-1``."""
    if groups.dim() != 1 or groups.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"groups must be an int [N] tensor, got {groups.dtype} {tuple(groups.shape)}")
    g = groups.long()
    order = torch.argsort(g, stable=True)
    counts = torch.bincount(g + 1, minlength=num_groups + 1)
    # the rows of group -1 sort first and get no delta
    return order[int(counts[0]):], torch.cumsum(counts[1:], 0).to(torch.int32)


def stack_a(factors) -> torch.Tensor:
    """``[(A_g [R_g, in], B_g)]`` -> ``[G, in, R]``, ``R = max R_g``, each ``A_g^T`` zero-padded."""
    width = max(a.shape[0] for a, _ in factors)
    pad = torch.nn.functional.pad
    return torch.stack([(a if a.shape[0] == width else pad(a, (0, 0, 0, width - a.shape[0]))).t()
                        for a, _ in factors])


def stack_b(factors, scalings=None) -> torch.Tensor:
    """``[(A_g, B_g [out, R_g])]`` -> ``[G, R, out]``, each ``B_g^T`` zero-padded (times
    ``scalings[g]`` when given, a ``[G]`` tensor)."""
    width = max(b.shape[1] for _, b in factors)
    pad = torch.nn.functional.pad
    w = torch.stack([(b if b.shape[1] == width else pad(b, (0, width - b.shape[1]))).t() for _, b in factors])
    return w if scalings is None else scaled(w, scalings)


def scaled(w: torch.Tensor, scalings: torch.Tensor) -> torch.Tensor:
    """``w`` ``[G, ...]`` with group g times ``scalings[g]`` (a ``[G]`` tensor), in w's dtype."""
    return w * scalings.to(w.dtype).view(-1, *([1] * (w.dim() - 1)))


class Factors:
    """The factors of one grouped LoRA delta: ``build()`` returns ``[(A_g [R_g, in], B_g [out,
    R_g])]``, one pair per group, computed from ``params`` (the adapters' own parameters, which
    are what the gradients go to); ``scalings[g]`` is group g's LoRA scaling. ``build`` is called
    once in the forward (no autograd) and once more in the backward: the padded ``[G, ...]`` stacks
    of every adapter's factors are rebuilt there rather than kept alive between the two.
    ``grad_sum``: ``(which, group)``: factor ``which`` ("a" or "b") is replicated over the process
    ``group`` while each rank sees only its share of the output gradient, so its gradient is
    all-reduced over ``group`` (identity forward, summed backward). ``stacked``: optional (see
    :class:`twinkle_megatron.lora.linear.StackedFactors`), builds the stacks at once, ``() -> (w_a
    [G, in, R], w_b [G, R, out])`` (w_b without the scalings), equal to :func:`stack_a` /
    :func:`stack_b` of ``build()``, and maps their gradients back to the parameters itself
    (``stacked.grads(dw_a, dw_b) -> [(param, grad)]``): a few ops instead of a few per group and
    an autograd pass, where the groups share one layout."""

    def __init__(self, build, params: Sequence[torch.Tensor], scalings: Sequence[float], grad_sum=None,
                 stacked=None):
        self.build, self.params, self.stacked = build, list(params), stacked
        device = self.params[0].device if self.params else None
        self.scalings = torch.tensor([float(v) for v in scalings], dtype=torch.float64, device=device)
        if grad_sum is not None and grad_sum[0] not in ("a", "b"):
            raise ValueError(f"grad_sum must be ('a' or 'b', group), got {grad_sum!r}")
        self.grad_sum = grad_sum

    def stacks(self, needs, *which: str):
        """The stacked factors ``which`` ("a", "b"; b scaled), rebuilt from the parameters; with
        autograd when a parameter needs a gradient (``needs``: one flag per parameter) and the
        gradients are to be found by autograd (no ``stacked``)."""
        with torch.set_grad_enabled(any(needs) and self.stacked is None):
            if self.stacked is not None:
                w_a, w_b = self.stacked()
                w_b = scaled(w_b, self.scalings)
                return tuple(w_a if w == "a" else w_b for w in which)
            pairs = self.build()
            return tuple(stack_a(pairs) if w == "a" else stack_b(pairs, self.scalings) for w in which)

    def grads(self, needs, which, stacks, grads):
        """The parameters' gradients (None where not needed, or where a parameter is not part of
        the stacks ``which``) from the gradients ``grads`` of the stacks ``stacks`` (from
        :meth:`stacks`)."""
        if not any(needs):
            return [None] * len(self.params)
        if self.stacked is not None:
            dws = dict(zip(which, grads))
            dw_b = dws.get("b")
            if dw_b is not None:   # the stack is s_g * B_g^T
                dw_b = scaled(dw_b, self.scalings)
            got = {id(p): g for p, g in self.stacked.grads(dws.get("a"), dw_b)}
            return [got.get(id(p)) if need else None for p, need in zip(self.params, needs)]
        wanted = [p for p, need in zip(self.params, needs) if need]
        got = iter(torch.autograd.grad(stacks, wanted, [g.to(s.dtype) for s, g in zip(stacks, grads)],
                                       allow_unused=True))
        return [next(got) if need else None for need in needs]

    def summed(self, which: str, dw: torch.Tensor) -> torch.Tensor:
        """``dw`` (the gradient of the stacked factor ``which``), all-reduced if ``grad_sum`` says so."""
        if self.grad_sum is not None and self.grad_sum[0] == which:
            import torch.distributed as dist
            dist.all_reduce(dw, group=self.grad_sum[1])
        return dw


def _unpermute(base, order, yp, rows: int):
    """``base`` (``[rows, M]`` or None: zeros) plus ``yp`` ``[len(order), M]`` added at rows ``order``
    (rows of no group keep ``base``). A fresh tensor; ``index_add`` measured 2-3x faster than
    ``zeros().index_copy_()`` and a separate add on this CPU."""
    if base is None:
        return yp.new_zeros(rows, yp.shape[1]).index_add_(0, order, yp)
    return base.index_add(0, order, yp.to(base.dtype))


def _permuted_grad(dy, order, dtype):
    return dy.index_select(0, order).to(dtype)


class _GroupedLora(torch.autograd.Function):
    """``base + unpermute((x[order] @ A^T[g]) @ (s B^T)[g])``: one permutation of the tokens into
    adapter segments, the two grouped matmuls, one permutation back (added to ``base``). Saves
    ``x``, the ``[N, R]`` rank-space activations and the adapters' parameters (no stacked or
    permuted copy)."""

    @staticmethod
    def forward(ctx, x, base, order, offsets, factors, backend, *params):
        import twinkle_kernels as tk
        with torch.no_grad():
            w_a, w_b = (w.to(x.dtype) for w in factors.stacks((False,), "a", "b"))
            hp = tk.grouped_matmul(x.index_select(0, order), w_a, offsets, backend=backend)
            y = _unpermute(base, order, tk.grouped_matmul(hp, w_b, offsets, backend=backend), x.shape[0])
        ctx.save_for_backward(x, order, offsets, hp)
        ctx.factors, ctx.backend = factors, backend
        return y

    @staticmethod
    def backward(ctx, dy):
        import twinkle_kernels as tk
        x, order, offsets, hp = ctx.saved_tensors
        factors, backend = ctx.factors, ctx.backend
        needs = ctx.needs_input_grad
        w_a, w_b = factors.stacks(needs[6:], "a", "b")
        with torch.no_grad():
            dhp, dw_b = tk.grouped_matmul_backward(_permuted_grad(dy, order, x.dtype), hp,
                                                   w_b.detach().to(x.dtype), offsets, backend=backend)
            dxp, dw_a = tk.grouped_matmul_backward(dhp, x.index_select(0, order), w_a.detach().to(x.dtype),
                                                   offsets, backend=backend)
            dx = x.new_zeros(x.shape).index_add_(0, order, dxp) if needs[0] else None
        dparams = factors.grads(needs[6:], ("a", "b"), (w_a, w_b),
                                (factors.summed("a", dw_a), factors.summed("b", dw_b)))
        return (dx, dy if needs[1] else None, None, None, None, None, *dparams)


def grouped_lora(x: torch.Tensor, segments: tuple, factors: Factors, *, base: Optional[torch.Tensor] = None,
                 backend: Optional[str] = None) -> torch.Tensor:
    """``base[i] + s_g * B_g A_g x[i]`` with ``g`` the group of row ``i`` (nothing added for rows of
    no group), for a layer with no communication between its two factors.

    x: ``[N, in]``; segments: :func:`sort_by_group` of the rows' groups; factors: :class:`Factors`
    (``A_g`` ``[R_g, in]``, ``B_g`` ``[out, R_g]``, cast to x's dtype); base: ``[N, out]`` (the
    layer's own output; None: zeros). Returns ``[N, out]`` in base's dtype (x's without base),
    differentiable in ``x``, ``base`` and ``factors.params``. Two grouped matmuls between one
    permutation of the rows and one back; ranks zero-padded to the largest (exact)."""
    order, offsets = segments
    return _GroupedLora.apply(x, base, order, offsets.to(x.device), factors, backend, *factors.params)


class _GroupedFactor(torch.autograd.Function):
    """One factor of :class:`_GroupedLora` (``which``: "a" or "b"), for a layer whose TP
    communication runs between the two: saves ``x`` and the parameters."""

    @staticmethod
    def forward(ctx, x, order, offsets, factors, which, backend, *params):
        import twinkle_kernels as tk
        with torch.no_grad():
            (w,) = factors.stacks((False,), which)
            w = w.to(x.dtype)
            y = _unpermute(None, order, tk.grouped_matmul(x.index_select(0, order), w, offsets, backend=backend),
                           x.shape[0])
        ctx.save_for_backward(x, order, offsets)
        ctx.factors, ctx.which, ctx.backend = factors, which, backend
        return y

    @staticmethod
    def backward(ctx, dy):
        import twinkle_kernels as tk
        x, order, offsets = ctx.saved_tensors
        factors, which = ctx.factors, ctx.which
        (w,) = factors.stacks(ctx.needs_input_grad[6:], which)
        with torch.no_grad():
            dxp, dw = tk.grouped_matmul_backward(_permuted_grad(dy, order, x.dtype), x.index_select(0, order),
                                                 w.detach().to(x.dtype), offsets, backend=ctx.backend)
            dx = x.new_zeros(x.shape).index_add_(0, order, dxp) if ctx.needs_input_grad[0] else None
        dparams = factors.grads(ctx.needs_input_grad[6:], (which,), (w,), (factors.summed(which, dw),))
        return (dx, None, None, None, None, None, *dparams)


def grouped_factor(x: torch.Tensor, segments: tuple, factors: Factors, which: str, *,
                   backend: Optional[str] = None) -> torch.Tensor:
    """One half of :func:`grouped_lora`: ``which="a"``: ``y[i] = A_g x[i]`` (``[N, in]`` ->
    ``[N, R]``, rows of a group of smaller rank zero-padded); ``"b"``: ``y[i] = s_g B_g x[i]``
    (``[N, R]`` -> ``[N, out]``). For layers whose TP communication runs between the two."""
    if which not in ("a", "b"):
        raise ValueError(f"which must be 'a' or 'b', got {which!r}")
    order, offsets = segments
    return _GroupedFactor.apply(x, order, offsets.to(x.device), factors, which, backend, *factors.params)


def lora_delta_reference(x: torch.Tensor, groups: torch.Tensor, factors, scalings) -> torch.Tensor:
    """The delta of several adapters, one plain LoRA per group: ``y[i] = s_g * B_g A_g x[i]``,
    ``g = groups[i]`` (0 where -1). x ``[N, in]``; factors ``[(A_g [R_g, in], B_g [out, R_g])]``."""
    y = x.new_zeros(x.shape[0], factors[0][1].shape[0])
    for e, ((a, b), s) in enumerate(zip(factors, scalings)):
        rows = (groups == e).nonzero().reshape(-1)
        y = y.index_copy(0, rows, s * (x[rows] @ a.t() @ b.t()))
    return y


def lora_delta(x: torch.Tensor, groups: torch.Tensor, factors, scalings, *, backend: Optional[str] = None):
    """:func:`lora_delta_reference` through :func:`grouped_lora` (no communication between the two
    factors; :mod:`.mixed` runs :func:`grouped_factor` twice where there is)."""
    pairs = list(factors)
    params = [t for pair in pairs for t in pair]
    return grouped_lora(x, sort_by_group(groups, len(pairs)), Factors(lambda: pairs, params, scalings),
                        backend=backend)
