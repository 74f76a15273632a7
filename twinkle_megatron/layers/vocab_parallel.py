"""Per-token log-probabilities and entropy from vocab-parallel logits, without gathering them.

Under tensor parallelism each rank holds logits for a contiguous slice of the vocabulary,
``[vocab_start, vocab_start + V_local)``. The log-softmax normaliser (a logsumexp), the target
logit and the entropy's ``sum_v p_v z_v`` are each reduced over the TP group from local pieces,
so the ``[N, V]`` full-vocabulary logits never exist on one rank.

    z = logits / temperature
    lse = log sum_v exp(z_v)                      (max and sum all-reduced over the group)
    logp[n] = z[n, target[n]] - lse[n]
    entropy[n] = lse[n] - sum_v softmax(z)[n, v] * z[n, v]

Backward is local (no communication): d logp / dz = onehot(target) - p and
d entropy / dz = -p * (z - sum_v p_v z_v), on this rank's vocabulary slice.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class VocabParallelLogpsEntropy(torch.autograd.Function):
    """logits [N, V_local] (fp32 math for fp16/bf16; float64 kept), target [N] int64 global
    ids -> (logps [N], entropy [N]; zeros unless ``with_entropy``)."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start: int, group, with_entropy: bool):
        # fp32 math for half inputs; float64 stays float64 (tests)
        z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        n, v_local = z.shape
        zmax = z.max(dim=-1).values
        _all_reduce(zmax, dist.ReduceOp.MAX, group)
        shifted = z - zmax[:, None]
        exp = shifted.exp()
        sum_exp = _all_reduce(exp.sum(-1), dist.ReduceOp.SUM, group)
        local = target - vocab_start
        here = (local >= 0) & (local < v_local)
        picked = shifted.gather(1, local.clamp(0, v_local - 1)[:, None])[:, 0] * here
        picked = _all_reduce(picked, dist.ReduceOp.SUM, group)
        log_sum = sum_exp.log()
        logps = picked - log_sum
        probs = exp / sum_exp[:, None]
        if with_entropy:
            # sum_v p_v * (z_v - zmax), reduced; entropy = log_sum - that
            mean_shifted = _all_reduce((probs * shifted).sum(-1), dist.ReduceOp.SUM, group)
            entropy = log_sum - mean_shifted
        else:
            mean_shifted = None
            entropy = torch.zeros_like(logps)
        ctx.save_for_backward(probs, shifted, local, here,
                              mean_shifted if mean_shifted is not None else logps.new_zeros(0))
        ctx.with_entropy = with_entropy
        ctx.in_dtype = logits.dtype
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps, grad_entropy):
        probs, shifted, local, here, mean_shifted = ctx.saved_tensors
        grad = -probs * grad_logps[:, None]
        rows = torch.nonzero(here)[:, 0]
        grad[rows, local[rows]] += grad_logps[rows]
        if ctx.with_entropy and grad_entropy is not None:
            grad = grad - probs * (shifted - mean_shifted[:, None]) * grad_entropy[:, None]
        return grad.to(ctx.in_dtype), None, None, None, None


def vocab_parallel_logps(logits: torch.Tensor, target: torch.Tensor, *, vocab_start: int = 0,
                         group=None, temperature: float = 1.0, with_entropy: bool = False
                         ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Per-token ``log p(target)`` and (``with_entropy``) entropy of ``softmax(logits / T)``.

    logits: [..., V_local] this rank's vocabulary slice starting at ``vocab_start``; target:
    [...] int global token ids (clamp ignored positions to a valid id: their values are
    returned but meaningless). ``group``: the tensor-parallel group (None: the full vocabulary
    is local). Returns fp32 tensors shaped like ``target``; entropy is None unless asked.
    """
    if not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature must be a positive number, got {temperature!r}")
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree")
    lead = target.shape
    z = logits.reshape(-1, logits.shape[-1])
    if temperature != 1.0:
        z = (z.float() if z.dtype in (torch.float16, torch.bfloat16) else z) / temperature
    logps, entropy = VocabParallelLogpsEntropy.apply(z, target.reshape(-1).long(), int(vocab_start),
                                                    group, bool(with_entropy))
    return logps.reshape(lead), (entropy.reshape(lead) if with_entropy else None)


class SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) over ``group`` in the forward; the backward passes the gradient through
    unchanged (every rank computes the same loss from the sum, and each piece's gradient is the
    sum's: megatron's ``reduce_from_tensor_model_parallel_region``)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        return _all_reduce(x, dist.ReduceOp.SUM, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def vocab_parallel_topk_logits(logits: torch.Tensor, indices: torch.Tensor, *, vocab_start: int = 0,
                               group=None) -> torch.Tensor:
    """The logits at ``indices`` [..., k] (global vocabulary ids) from this rank's vocabulary slice
    ``logits`` [..., V_local] starting at ``vocab_start``: each rank gathers the ids in its slice
    (0 for the others) and the pieces are summed over the TP ``group`` (None: the whole vocabulary
    is local). Returns fp32 (float64 kept) [..., k], differentiable in ``logits``."""
    if logits.shape[:-1] != indices.shape[:-1]:
        raise ValueError(f"logits {tuple(logits.shape)} and indices {tuple(indices.shape)} disagree")
    v_local = logits.shape[-1]
    local = indices.long() - int(vocab_start)
    here = (local >= 0) & (local < v_local)
    z = logits.gather(-1, local.clamp(0, v_local - 1))
    z = z.float() if z.dtype in (torch.float16, torch.bfloat16) else z
    z = torch.where(here, z, torch.zeros((), dtype=z.dtype, device=z.device))
    if group is not None and dist.get_world_size(group) > 1:
        z = SumOverGroup.apply(z, group)
    return z


def merge_topk(values: torch.Tensor, ids: torch.Tensor, zmax: torch.Tensor, sum_exp: torch.Tensor, k: int,
               group=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The global top-k log-softmax from each rank's piece of the vocabulary: ``values`` /
    ``ids`` [N, k_local] this rank's largest (tempered) logits and their global ids (-inf where a
    shard has fewer than k entries), ``zmax`` [N] its maximum and ``sum_exp`` [N] its
    ``sum exp(z - zmax)``. The k candidates of every rank of ``group`` are all-gathered and the
    top k of them kept; the log-sum-exp is all-reduced (max, then the rescaled sums). Returns
    (log-probs [N, k] sorted descending, ids [N, k] int64), no gradient."""
    tp = dist.get_world_size(group) if group is not None else 1
    if tp > 1:
        gmax = zmax.clone()
        dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=group)
        sum_exp = sum_exp * (zmax - gmax).exp()
        dist.all_reduce(sum_exp, group=group)
        zmax = gmax
        vs = [torch.empty_like(values) for _ in range(tp)]
        js = [torch.empty_like(ids) for _ in range(tp)]
        dist.all_gather(vs, values.contiguous(), group=group)
        dist.all_gather(js, ids.contiguous(), group=group)
        values, ids = torch.cat(vs, -1), torch.cat(js, -1)
    top, at = values.topk(k, dim=-1)
    lse = zmax + sum_exp.log()
    return top - lse[:, None], ids.gather(-1, at)


def local_topk(z: torch.Tensor, k: int, vocab_start: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """z [N, V_local] -> its k largest values and their global ids [N, k] (padded with -inf / 0
    when V_local < k)."""
    kk = min(k, z.shape[-1])
    v, i = z.topk(kk, dim=-1)
    i = i + int(vocab_start)
    if kk < k:
        v = torch.cat([v, v.new_full((v.shape[0], k - kk), float("-inf"))], -1)
        i = torch.cat([i, i.new_zeros(i.shape[0], k - kk)], -1)
    return v, i


@torch.no_grad()
def vocab_parallel_topk(logits: torch.Tensor, k: int, *, vocab_start: int = 0, group=None,
                        temperature: float = 1.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """The top ``k`` of ``log_softmax(logits / temperature)`` over the whole vocabulary from this
    rank's slice ``logits`` [..., V_local] (starting at ``vocab_start``; ``group`` the TP group,
    None: the whole vocabulary is local): each rank's top k with global ids, merged over the group
    (:func:`merge_topk`). Returns (log-probs fp32 (float64 kept) [..., k] sorted descending, ids
    int64 [..., k])."""
    lead = logits.shape[:-1]
    z = logits.reshape(-1, logits.shape[-1])
    z = z.float() if z.dtype in (torch.float16, torch.bfloat16) else z
    z = z / temperature
    zmax = z.max(-1).values
    sum_exp = (z - zmax[:, None]).exp().sum(-1)
    v, i = local_topk(z, k, vocab_start)
    lp, ids = merge_topk(v, i, zmax, sum_exp, k, group)
    return lp.reshape(*lead, k), ids.reshape(*lead, k)


def vocab_parallel_jsd(logits: torch.Tensor, teacher_logits: torch.Tensor, valid: torch.Tensor, *, beta: float,
                       temperature: float, group=None) -> torch.Tensor:
    """GKD's generalized JSD per token from vocab-parallel student logits ``[rows, s, V_local]``
    and the teacher's logits over the same vocabulary slice ``[rows, s, V_local]``; ``valid``
    ``[rows, s]`` bool. The log-sum-exps and the divergence's sums are all-reduced over ``group``
    (no gathered ``[.., V]`` tensor); the backward is local to the slice. Returns ``[rows, s]``
    fp32 (float64 for float64 logits), 0 where not ``valid``, differentiable in ``logits``
    (:func:`twinkle_kernels.linear_ce.jsd.fused_linear_jsd` with the logits given)."""
    from twinkle_kernels.linear_ce.jsd import fused_linear_jsd
    rows, s, v = logits.shape
    if tuple(teacher_logits.shape) != (rows, s, v) or tuple(valid.shape) != (rows, s):
        raise ValueError(f"teacher_logits {tuple(teacher_logits.shape)} and valid {tuple(valid.shape)} must be "
                         f"{(rows, s, v)} and {(rows, s)} for logits {tuple(logits.shape)}")
    group = group if group is not None and dist.get_world_size(group) > 1 else None
    z = logits if logits.dtype == torch.float64 else logits.float()
    d = fused_linear_jsd(z.reshape(rows * s, v), None, teacher_logits.reshape(rows * s, v),
                         valid=valid.reshape(-1), beta=beta, temperature=temperature, tp_group=group)
    return d.reshape(rows, s)
