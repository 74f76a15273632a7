"""Token routing for mixture-of-experts: group token copies by expert and back.

A router picks ``k`` experts per token (``top_k_index [T, k]``). The ``S = T * k`` (token,
slot) pairs are numbered ``s = t * k + j``. :func:`make_routing_plan` sorts them by expert
with a *stable* sort, so inside one expert the rows keep token order and the result never
depends on thread timing. Both directions are gathers (never scatters with repeated
indices), so forward and backward are deterministic on every device.

Example::

    plan = make_routing_plan(top_k_index, num_experts)
    xp = permute_tokens(hidden_states, plan)                    # [S, H], grouped by expert
    yp = grouped_matmul(xp, w, plan.offsets)                    # any per-expert map
    out = unpermute_tokens(yp, top_k_weights, plan)             # [T, H], weighted sum over k
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["RoutingPlan", "make_routing_plan", "permute_tokens", "unpermute_tokens"]


@dataclass(frozen=True)
class RoutingPlan:
    """Where each (token, slot) pair goes.

    Attributes:
        perm: int64 ``[S]``; permuted row ``r`` holds pair ``perm[r]`` (``= t * k + j``).
        inverse: int64 ``[S]``; pair ``s`` sits at permuted row ``inverse[s]``.
        row_map: int64 ``[S]``; the source token of permuted row ``r`` (``perm // k``).
        tokens_per_expert: int64 ``[E]``.
        offsets: int32 ``[E]``; cumulative end rows (the ``torch._grouped_mm`` ``offs``).
        num_tokens, top_k: ``T`` and ``k``.
    """
    perm: torch.Tensor
    inverse: torch.Tensor
    row_map: torch.Tensor
    tokens_per_expert: torch.Tensor
    offsets: torch.Tensor
    num_tokens: int
    top_k: int


def make_routing_plan(top_k_index: torch.Tensor, num_experts: int) -> RoutingPlan:
    """Sort the ``T * k`` routed pairs by expert (stable).

    Args:
        top_k_index: integer ``[T, k]``, values in ``[0, num_experts)`` (checked by
            :func:`twinkle_kernels.moe_experts`; not here, to avoid a second device sync).
        num_experts: ``E``.
    """
    if top_k_index.dim() != 2:
        raise ValueError(f"top_k_index must be [T, k], got shape {tuple(top_k_index.shape)}")
    num_tokens, top_k = top_k_index.shape
    flat = top_k_index.reshape(-1).to(torch.int64)
    _, perm = torch.sort(flat, stable=True)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    counts = torch.bincount(flat, minlength=num_experts)
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    return RoutingPlan(perm, inverse, perm // max(top_k, 1), counts, offsets, num_tokens, top_k)


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, row_map, inverse, num_tokens, top_k):
        ctx.save_for_backward(inverse)
        ctx.shape = (num_tokens, top_k)
        return x.index_select(0, row_map)

    @staticmethod
    def backward(ctx, dxp):
        (inverse,) = ctx.saved_tensors
        t, k = ctx.shape
        # dx[t] = sum_j dxp[inverse[t*k+j]]: a gather then a fixed-order sum, no atomics.
        g = dxp.index_select(0, inverse).view(t, k, dxp.shape[1])
        acc = torch.float64 if dxp.dtype == torch.float64 else torch.float32
        return g.sum(1, dtype=acc).to(dxp.dtype), None, None, None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, yp, weights, plan_tensors, num_tokens, top_k):
        perm, inverse, row_map = plan_tensors
        ct = torch.float64 if yp.dtype == torch.float64 else torch.float32
        g = yp.index_select(0, inverse).view(num_tokens, top_k, yp.shape[1])
        out = torch.bmm(weights.to(ct).unsqueeze(1), g.to(ct)).squeeze(1)
        ctx.save_for_backward(yp, weights, perm, inverse, row_map)
        ctx.shape = (num_tokens, top_k)
        return out.to(yp.dtype)

    @staticmethod
    def backward(ctx, dout):
        yp, weights, perm, inverse, row_map = ctx.saved_tensors
        t, k = ctx.shape
        ct = torch.float64 if yp.dtype == torch.float64 else torch.float32
        dyp = dw = None
        if ctx.needs_input_grad[0]:
            # d yp[r] = w[pair perm[r]] * dout[token of r]
            w_rows = weights.reshape(-1).index_select(0, perm).to(ct).unsqueeze(1)
            dyp = (dout.index_select(0, row_map).to(ct) * w_rows).to(yp.dtype)
        if ctx.needs_input_grad[1]:
            g = yp.index_select(0, inverse).view(t, k, yp.shape[1]).to(ct)
            dw = torch.bmm(g, dout.to(ct).unsqueeze(2)).squeeze(2).to(weights.dtype)
        return dyp, dw, None, None, None


def permute_tokens(hidden_states: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
    """``[T, H] -> [S, H]``: row ``r`` is ``hidden_states[plan.row_map[r]]``; differentiable."""
    return _Permute.apply(hidden_states, plan.row_map, plan.inverse, plan.num_tokens, plan.top_k)


def unpermute_tokens(expert_out: torch.Tensor, top_k_weights: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
    """``[S, H] -> [T, H]``: ``out[t] = sum_j top_k_weights[t, j] * expert_out[plan.inverse[t*k+j]]``.

    The sum runs in fp32 (float64 for float64); the result has ``expert_out.dtype``.
    Differentiable in ``expert_out`` and ``top_k_weights``.
    """
    if top_k_weights.shape != (plan.num_tokens, plan.top_k):
        raise ValueError(f"top_k_weights must have shape {(plan.num_tokens, plan.top_k)} (like top_k_index), "
                         f"got {tuple(top_k_weights.shape)}")
    return _Unpermute.apply(expert_out, top_k_weights, (plan.perm, plan.inverse, plan.row_map),
                            plan.num_tokens, plan.top_k)
