"""Fused linear cross-entropy with the LM head sharded over the vocabulary (Megatron's tensor
parallelism): rank ``r`` of the group holds rows ``[r * Vs, (r + 1) * Vs)`` of the [V, H] weight.

Forward: each rank runs the chunked engine on its shard, giving per row its shard's log-sum-exp,
softmax expectation of z, sum of z and (where the label is in the shard) the target logit; one MAX
and one SUM all-reduce of [N]-sized statistics combine them (no [N, V] tensor, no per-chunk
collective). Backward, as Megatron's vocab-parallel cross entropy: each rank recomputes its
shard's softmax with the global statistics, forms d(z) for its columns, and the hidden gradient's
partial sums over shards are all-reduced (reduce-scattered along the sequence under sequence
parallelism, where the forward all-gathered the hidden states).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from .. import _checks
from ._chunked import TORCH_ENGINE, Params, default_chunk, grad_buffers, row_grads


def _engine(device: torch.device):
    if device.type == "cuda":
        from . import _triton
        return _triton.ENGINE
    # The C++ loop has no "label in another shard" row; the chunked torch rows do.
    return TORCH_ENGINE


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 (the sequence under Megatron's sequence parallelism); backward sums
    the full gradient over the group and keeps this rank's slice (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group):
        world = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.group, ctx.rank, ctx.n = group, dist.get_rank(group), x.shape[0]
        return torch.cat(parts, 0)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g[ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n], None


class _VocabParallelFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, b, y, group, params: Params, V: int, reduction: str, chunk: int, reduce_dh: bool):
        N, Vs = h.shape[0], w.shape[0]
        rank = dist.get_rank(group)
        v0 = rank * Vs
        valid = y != params.ignore_index
        here = valid & (y >= v0) & (y < v0 + Vs)
        # local label: in-shard index, Vs for "in another shard", ignore_index kept
        y_loc = torch.where(here, y - v0, torch.where(valid, torch.full_like(y, Vs), y))
        engine = _engine(h.device)
        lse_r, loss_r, logp_r, ent_r = (torch.empty(N, dtype=torch.float32, device=h.device) for _ in range(4))
        # label_smoothing=1 over the shard makes the engine's loss lse - sum(z) / Vs: the shard's sum of z.
        local = params._replace(label_smoothing=1.0, vocab_total=Vs)
        engine.fwd(h, w, b, y_loc, local, chunk, lse_r, loss_r, logp_r, ent_r, 1.0, None, None, None)
        m = lse_r.clone()
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        e = torch.exp(lse_r - m)
        zero = torch.zeros_like(lse_r)
        stats = torch.stack([e, e * (lse_r - ent_r), torch.where(here, logp_r + lse_r, zero),
                             (lse_r - loss_r) * Vs])
        dist.all_reduce(stats, group=group)
        s, pz, zy, sz = stats[0], stats[1] / stats[0], stats[2], stats[3]
        lse = m + torch.log(s)
        eps = params.label_smoothing
        lse = torch.where(valid, lse, zero)
        loss = torch.where(valid, lse - (1 - eps) * zy - eps * sz / V, zero)
        logp = torch.where(valid, zy - lse, zero)
        ent = torch.where(valid, lse - pz, zero)
        n_valid = valid.sum().to(torch.float32)
        if reduction == "none":
            out = loss
        elif reduction == "sum":
            out = loss.sum()
        else:
            out = loss.sum() / n_valid
        ctx.set_materialize_grads(False)
        ctx.params, ctx.group, ctx.reduction, ctx.chunk, ctx.V, ctx.reduce_dh = params, group, reduction, chunk, V, reduce_dh
        ctx.save_for_backward(h, w, b, y_loc, lse, ent, n_valid)
        return out, logp, ent

    @staticmethod
    def backward(ctx, g_loss, g_logp, g_ent):
        h, w, b, y_loc, lse, ent, n_valid = ctx.saved_tensors
        N = h.shape[0]
        ga, gb, gc = row_grads(g_loss, g_logp, g_ent, ctx.reduction, n_valid, N)
        if ga is None and gb is None and gc is None:
            return (None,) * 10
        dh, dw_acc, db_acc = grad_buffers(h, w, b)
        params = ctx.params._replace(vocab_total=ctx.V)
        _engine(h.device).bwd(h, w, b, y_loc, params, ctx.chunk, lse, ent, ga, gb, gc, dh, dw_acc, db_acc)
        if ctx.reduce_dh:
            dist.all_reduce(dh, group=ctx.group)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        return (dh if need_h else None, dw_acc.to(w.dtype) if need_w else None,
                db_acc.to(b.dtype) if need_b and db_acc is not None else None) + (None,) * 7


def vocab_parallel_fused_linear_cross_entropy(hidden: torch.Tensor, weight_shard: torch.Tensor,
                                              labels: torch.Tensor, tp_group=None, *,
                                              bias: Optional[torch.Tensor] = None, ignore_index: int = -100,
                                              reduction: str = "mean", label_smoothing: float = 0.0,
                                              logit_softcap: Optional[float] = None, temperature: float = 1.0,
                                              return_logps: bool = False, return_entropy: bool = False,
                                              chunk_size: Optional[int] = None, sequence_parallel: bool = False):
    """:func:`~twinkle_kernels.fused_linear_cross_entropy` with ``weight`` split over ``tp_group``.

    Args:
        hidden: ``[..., H]``, the same on every rank; with ``sequence_parallel``, this rank's slice
            of dim 0 (the sequence, as Megatron splits it), gathered here.
        weight_shard: ``[V / tp, H]``, rows ``[rank * V/tp, (rank + 1) * V/tp)`` of the full head
            (Megatron's equal vocabulary partition); hidden's dtype.
        labels: global vocabulary ids, ``[...]`` matching the (gathered) hidden's leading dims,
            the same on every rank; ``ignore_index`` must be negative.
        bias: optional ``[V / tp]`` shard of the bias.
        tp_group: the tensor-parallel process group (None: the default group).

    The other arguments are as in :func:`~twinkle_kernels.fused_linear_cross_entropy` (the full
    vocabulary size ``V = tp * V/tp`` is what the smoothing term averages over).

    Returns the same values on every rank as the single-process op on the unsharded weight;
    gradients reach hidden (summed over the group), the weight shard and the bias shard.
    """
    _checks.tensor("hidden", hidden, ndim_min=1)
    _checks.tensor("weight_shard", weight_shard)
    if weight_shard.dim() != 2 or weight_shard.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight_shard must have shape [V / tp, {hidden.shape[-1]}], got {tuple(weight_shard.shape)}")
    _checks.same_dtype(("hidden", "weight_shard"), (hidden, weight_shard))
    if not isinstance(labels, torch.Tensor) or labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor, got {getattr(labels, 'dtype', type(labels).__name__)}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int) or ignore_index >= 0:
        raise ValueError(f"ignore_index must be a negative int in the vocab-parallel form, got {ignore_index!r}")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be one of ('mean', 'sum', 'none'), got {reduction!r}")
    label_smoothing = _checks.finite_float("label_smoothing", label_smoothing)
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    softcap = None if logit_softcap is None else _checks.positive_float("logit_softcap", logit_softcap)
    temperature = _checks.positive_float("temperature", temperature)
    if not dist.is_initialized():
        raise RuntimeError("vocab_parallel_fused_linear_cross_entropy needs an initialized torch.distributed")
    world = dist.get_world_size(tp_group)
    if sequence_parallel and world > 1:
        hidden = _GatherSequence.apply(hidden, tp_group)
    H = hidden.shape[-1]
    N = math.prod(hidden.shape[:-1])
    if labels.shape != hidden.shape[:-1] and tuple(labels.shape) != (N,):
        raise ValueError(f"labels must have shape {tuple(hidden.shape[:-1])} (the gathered hidden's leading dims) "
                         f"or [{N}], got {tuple(labels.shape)}")
    Vs = weight_shard.shape[0]
    V = Vs * world
    y = labels.reshape(N).to(torch.int64)
    bad = ((y < 0) | (y >= V)) & (y != ignore_index)
    if N and bool(bad.any()):
        raise ValueError(f"labels must be in [0, {V}) (the full vocabulary) or ignore_index={ignore_index}; "
                         f"got {int(y[bad][0])}")
    if bias is not None:
        _checks.tensor("bias", bias)
        if tuple(bias.shape) != (Vs,):
            raise ValueError(f"bias must have shape [{Vs}] (this rank's shard), got {tuple(bias.shape)}")
    h2 = hidden.reshape(N, H)
    if not h2.is_contiguous():
        h2 = h2.contiguous()
    w = weight_shard if weight_shard.is_contiguous() else weight_shard.contiguous()
    params = Params(ignore_index, label_smoothing, softcap or 0.0, temperature)
    chunk = chunk_size or default_chunk(N, Vs, hidden.dtype)
    loss, logp, ent = _VocabParallelFunction.apply(h2, w, bias, y, tp_group, params, V, reduction, chunk,
                                                   not sequence_parallel)
    shape = labels.shape
    out = [loss.view(shape) if reduction == "none" else loss]
    if not (return_logps or return_entropy):
        return out[0]
    if return_logps:
        out.append(logp.view(shape))
    if return_entropy:
        out.append(ent.view(shape))
    return tuple(out)
