"""Fused linear generalized Jensen-Shannon divergence (GKD's loss against a full-vocabulary
teacher): the student's LM head ``hidden @ weight.T`` and TRL's generalized JSD against the
teacher's logits, per token, without the student's ``[N, V]`` logits.

With ``s = log_softmax(z_student / T)`` and ``t = log_softmax(z_teacher / T)`` over the vocabulary::

    beta = 0:    l = KL(T || S) = sum_v T_v (t_v - s_v)
    beta = 1:    l = KL(S || T) = sum_v S_v (s_v - t_v)
    otherwise:   m = log((1 - beta) S + beta T)
                 l = beta * KL(T || M) + (1 - beta) * KL(S || M)

(terms where a probability is 0 count 0, as ``F.kl_div``). Every term is an elementwise function
of ``(s_v, t_v)``, so one token needs only the two log-sum-exps:

- pass 1 (forward): token chunk by vocabulary chunk, an online max / log-sum-exp of the student's
  and the teacher's logits; under tensor parallelism one MAX and one SUM all-reduce of ``[N]``
  statistics make them global;
- pass 2 (forward): the chunks again (the student's logits recomputed), the divergence terms and
  ``sum_v G_v`` where ``G_v = dl / ds_v``; one SUM all-reduce;
- backward: the chunks once more, ``dl / dz_v = (G_v - S_v sum_u G_u) / T`` (``G = -T_v`` for
  beta 0, ``S_v (s_v - t_v) + S_v`` for beta 1, ``(1 - beta) S_v (s_v - m_v)`` otherwise), and
  the GEMMs into the hidden, weight and bias gradients.

At most ``[chunk_tokens, chunk_vocab]`` logits exist at once (a few fp32 temporaries of that
size); the teacher's logits are read a chunk at a time and never copied whole. The chunk loop is
torch operations (``torch.mm`` and elementwise), so it runs on every device the fused
cross-entropy runs on (CPU, CUDA, Ascend NPU); ``backend="reference"`` is the unfused formula.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from .. import _checks

__all__ = ["fused_linear_jsd", "linear_jsd_reference", "jsd_rows"]

_BUDGET = 1 << 22   # elements of one [chunk_tokens, chunk_vocab] temporary (16 MB in fp32)


def _compute_dtype(*ts) -> torch.dtype:
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in ts) else torch.float32


def jsd_rows(s_logits: torch.Tensor, t_logits: torch.Tensor, lse_s: torch.Tensor, lse_t: torch.Tensor,
             beta: float):
    """One chunk's terms: ``s_logits`` / ``t_logits`` ``[C, Vc]`` already divided by the
    temperature, ``lse_s`` / ``lse_t`` ``[C]`` their global log-sum-exps. Returns
    ``(l [C], G [C, Vc], S [C, Vc])``: this chunk's part of each row's divergence, ``dl / ds``
    per element (``s`` the student's log-probs) and the student's probabilities."""
    log_s = s_logits - lse_s[:, None]
    log_t = t_logits - lse_t[:, None]
    ps, pt = log_s.exp(), log_t.exp()
    zero = torch.zeros((), dtype=log_s.dtype, device=log_s.device)
    if beta == 0.0:
        term = torch.where(pt > 0, pt * (log_t - log_s), zero)
        g = -pt
    elif beta == 1.0:
        term = torch.where(ps > 0, ps * (log_s - log_t), zero)
        g = term + ps
    else:
        log_m = torch.logaddexp(log_s + math.log(1.0 - beta), log_t + math.log(beta))
        ks = torch.where(ps > 0, ps * (log_s - log_m), zero)
        term = beta * torch.where(pt > 0, pt * (log_t - log_m), zero) + (1.0 - beta) * ks
        g = (1.0 - beta) * ks
    return term.sum(1), g, ps


def _online(m, l, z):
    """Running max ``m`` and ``sum exp(z - m)`` ``l`` [C] updated with the chunk ``z`` [C, Vc]."""
    new = torch.maximum(m, z.max(1).values)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)   # rows all -inf so far
    l = l * (m - safe).exp() + (z - safe[:, None]).exp().sum(1)
    return new, l


def _global_lse(m, l, group):
    """log-sum-exp from per-rank (max, sum exp(z - max)), combined over ``group``."""
    if group is not None:
        big = m.clone()
        dist.all_reduce(big, op=dist.ReduceOp.MAX, group=group)
        safe = torch.where(torch.isinf(big), torch.zeros_like(big), big)
        l = l * (m - safe).exp()
        dist.all_reduce(l, group=group)
        m = safe
    else:
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    return m + l.log()


def _student(h, w, b, rows, v0, v1, dtype, temperature):
    """The student's logits / temperature of ``rows`` over the columns ``[v0, v1)``: ``[C, v1 - v0]``."""
    if w is None:
        z = h[rows, v0:v1].to(dtype)
    else:
        z = torch.mm(h[rows].to(dtype), w[v0:v1].to(dtype).T)
        if b is not None:
            z = z + b[v0:v1].to(dtype)
    return z / temperature


def _blocks(h, w, b, teacher, idx, dtype, temperature, chunk_tokens, chunk_vocab):
    """The token x vocabulary blocks every pass walks: for each chunk of ``idx`` (``rows = idx[r0:r1]``),
    yields ``(r0, r1, rows, vocab)``, where ``vocab`` yields ``(v0, v1, zs, zt)``: the student's
    (recomputed) and the teacher's logits / temperature of those rows and columns, ``[C, Vc]``."""
    vs = teacher.shape[1]

    def vocab(rows):
        for v0 in range(0, vs, chunk_vocab):
            v1 = min(vs, v0 + chunk_vocab)
            yield v0, v1, _student(h, w, b, rows, v0, v1, dtype, temperature), \
                teacher[rows, v0:v1].to(dtype) / temperature
    n = idx.numel()
    for r0 in range(0, n, chunk_tokens):
        r1 = min(n, r0 + chunk_tokens)
        rows = idx[r0:r1]
        yield r0, r1, rows, vocab(rows)


class LinearJSDFunction(torch.autograd.Function):
    """Per-token divergence ``[N]`` (0 on rows not in ``idx``). ``w`` None: ``h`` is already the
    student's logits ``[N, Vs]`` (the unfused path); else ``h`` ``[N, H]`` and ``w`` ``[Vs, H]``."""

    @staticmethod
    def forward(ctx, h, w, b, teacher, idx, beta: float, temperature: float, group, reduce_dh: bool,
                chunk_tokens: int, chunk_vocab: int):
        dtype = _compute_dtype(h, w, teacher)
        n = idx.numel()
        dev = h.device
        blocks = (h, w, b, teacher, idx, dtype, temperature, chunk_tokens, chunk_vocab)
        m_s, m_t = (torch.full((n,), float("-inf"), dtype=dtype, device=dev) for _ in range(2))
        l_s, l_t = (torch.zeros(n, dtype=dtype, device=dev) for _ in range(2))
        for r0, r1, _, vocab in _blocks(*blocks):              # pass 1: the log-sum-exps
            for _, _, zs, zt in vocab:
                m_s[r0:r1], l_s[r0:r1] = _online(m_s[r0:r1], l_s[r0:r1], zs)
                m_t[r0:r1], l_t[r0:r1] = _online(m_t[r0:r1], l_t[r0:r1], zt)
        lse_s, lse_t = _global_lse(m_s, l_s, group), _global_lse(m_t, l_t, group)
        sums = torch.zeros(2, n, dtype=dtype, device=dev)          # divergence, sum_v G_v
        for r0, r1, _, vocab in _blocks(*blocks):              # pass 2: the divergence, sum_v G_v
            for _, _, zs, zt in vocab:
                term, g, _ = jsd_rows(zs, zt, lse_s[r0:r1], lse_t[r0:r1], beta)
                sums[0, r0:r1] += term
                sums[1, r0:r1] += g.sum(1)
        if group is not None:
            dist.all_reduce(sums, group=group)
        out = torch.zeros(h.shape[0], dtype=dtype, device=dev)
        out[idx] = sums[0]
        ctx.save_for_backward(h, w, b, teacher, idx, lse_s, lse_t, sums[1].clone())
        ctx.args = (beta, temperature, group, reduce_dh, chunk_tokens, chunk_vocab, dtype)
        return out

    @staticmethod
    def backward(ctx, g_out):
        h, w, b, teacher, idx, lse_s, lse_t, sum_g = ctx.saved_tensors
        beta, temperature, group, reduce_dh, chunk_tokens, chunk_vocab, dtype = ctx.args
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if g_out is None or not (need_h or need_w or need_b):
            return (None,) * 11
        dev = h.device
        scale = g_out.to(dtype)[idx] / temperature                 # [n]
        dh = torch.zeros(h.shape, dtype=dtype, device=dev) if need_h else None
        dw = torch.zeros(w.shape, dtype=dtype, device=dev) if (need_w and w is not None) else None
        db = torch.zeros(b.shape, dtype=dtype, device=dev) if (need_b and b is not None) else None
        for r0, r1, rows, vocab in _blocks(h, w, b, teacher, idx, dtype, temperature, chunk_tokens, chunk_vocab):
            dh_rows = None
            if w is not None and need_h:
                dh_rows = torch.zeros(r1 - r0, h.shape[1], dtype=dtype, device=dev)
            hc = h[rows].to(dtype) if dw is not None else None
            for v0, v1, zs, zt in vocab:
                _, g, ps = jsd_rows(zs, zt, lse_s[r0:r1], lse_t[r0:r1], beta)
                dz = (g - ps * sum_g[r0:r1, None]) * scale[r0:r1, None]
                if w is None:
                    if need_h:
                        dh[rows, v0:v1] = dz
                    continue
                if dh_rows is not None:
                    dh_rows += torch.mm(dz, w[v0:v1].to(dtype))
                if dw is not None:
                    dw[v0:v1] += torch.mm(dz.T, hc)
                if db is not None:
                    db[v0:v1] += dz.sum(0)
            if dh_rows is not None:
                dh[rows] = dh_rows
        if dh is not None and w is not None and reduce_dh and group is not None:
            dist.all_reduce(dh, group=group)
        return (None if dh is None else dh.to(h.dtype), None if dw is None else dw.to(w.dtype),
                None if db is None else db.to(b.dtype)) + (None,) * 8


def default_chunks(n: int, vs: int):
    """(chunk_tokens, chunk_vocab): ``[chunk_tokens, chunk_vocab]`` within about 4M elements."""
    cv = max(1, min(vs, 8192))
    return max(1, min(max(n, 1), _BUDGET // cv)), cv


def linear_jsd_reference(hidden: torch.Tensor, weight: Optional[torch.Tensor], teacher_logits: torch.Tensor, *,
                         valid: Optional[torch.Tensor] = None, beta: float = 0.5, temperature: float = 1.0,
                         bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The unfused formula (plain torch autograd over the ``[N, V]`` logits): per-token divergence
    ``[N]`` (0 where ``valid`` is False); ``weight`` None: ``hidden`` is the student's logits."""
    dtype = _compute_dtype(hidden, weight, teacher_logits)
    z = hidden.to(dtype) if weight is None else hidden.to(dtype) @ weight.to(dtype).T
    if bias is not None:
        z = z + bias.to(dtype)
    s = torch.log_softmax(z / temperature, -1)
    t = torch.log_softmax(teacher_logits.to(dtype) / temperature, -1)

    def kl(lp, lq):
        p = lp.exp()
        return (p * torch.where(p > 0, lp - lq, torch.zeros_like(lp))).sum(-1)
    if beta == 0.0:
        out = kl(t, s)
    elif beta == 1.0:
        out = kl(s, t)
    else:
        m = torch.logaddexp(s + math.log(1.0 - beta), t + math.log(beta))
        out = beta * kl(t, m) + (1.0 - beta) * kl(s, m)
    if valid is not None:
        out = torch.where(valid.reshape(-1), out, torch.zeros_like(out))
    return out


def fused_linear_jsd(hidden: torch.Tensor, weight: Optional[torch.Tensor], teacher_logits: torch.Tensor, *,
                     valid: Optional[torch.Tensor] = None, beta: float = 0.5, temperature: float = 1.0,
                     bias: Optional[torch.Tensor] = None, tp_group=None, reduce_dh: bool = True,
                     chunk_tokens: Optional[int] = None, chunk_vocab: Optional[int] = None,
                     backend: Optional[str] = None) -> torch.Tensor:
    """Per-token generalized JSD between ``softmax((hidden @ weight.T + bias) / temperature)`` and
    ``softmax(teacher_logits / temperature)`` (see the module docstring), without the ``[N, V]``
    student logits.

    Args:
        hidden: ``[N, H]`` float (float32 / bfloat16 / float16 computed in fp32, float64 in
            float64); or, with ``weight`` None, the student's logits ``[N, V / tp]`` themselves.
        weight: ``[V / tp, H]`` the LM head (this rank's vocabulary shard under ``tp_group``).
        teacher_logits: ``[N, V / tp]`` float, the teacher's raw logits over the same vocabulary
            columns as ``weight``'s rows (no gradient reaches them).
        valid: ``[N]`` bool, the tokens to compute (others give 0 and cost nothing); None: all.
        beta: in ``[0, 1]``; temperature: > 0, divides both sides' logits.
        bias: optional ``[V / tp]``.
        tp_group: the tensor-parallel group the vocabulary is split over (None: one shard); the
            hidden states are the same on every rank of it.
        reduce_dh: all-reduce the hidden gradient over ``tp_group`` (False when the caller's
            sequence-parallel gather reduce-scatters it).
        chunk_tokens, chunk_vocab: the ``[tokens, vocabulary]`` block (default
            :func:`default_chunks`, about 4M elements).
        backend: None / ``"auto"`` / ``"chunked"`` (the chunk loop) or ``"reference"`` (the
            unfused formula, one shard only).

    Returns ``[N]`` fp32 (float64 for float64 inputs), differentiable in hidden, weight and bias,
    the same on every rank of ``tp_group``.
    """
    _checks.tensor("hidden", hidden, ndim_min=2)
    _checks.tensor("teacher_logits", teacher_logits, ndim_min=2)
    if hidden.dim() != 2 or teacher_logits.dim() != 2:
        raise ValueError(f"hidden and teacher_logits must be 2-d ([N, H], [N, V]), got {tuple(hidden.shape)} and "
                         f"{tuple(teacher_logits.shape)}")
    n = hidden.shape[0]
    if weight is None:
        vs = hidden.shape[1]
    else:
        _checks.tensor("weight", weight)
        if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
            raise ValueError(f"weight must have shape [V, {hidden.shape[1]}], got {tuple(weight.shape)}")
        vs = weight.shape[0]
    if tuple(teacher_logits.shape) != (n, vs):
        raise ValueError(f"teacher_logits must have shape [{n}, {vs}] (tokens, the student's vocabulary "
                         f"columns), got {tuple(teacher_logits.shape)}")
    if not teacher_logits.is_floating_point():
        raise ValueError(f"teacher_logits must be a float tensor, got {teacher_logits.dtype}")
    if bias is not None and tuple(bias.shape) != (vs,):
        raise ValueError(f"bias must have shape [{vs}], got {tuple(bias.shape)}")
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta!r}")
    temperature = _checks.positive_float("temperature", temperature)
    if valid is None:
        valid = torch.ones(n, dtype=torch.bool, device=hidden.device)
    valid = valid.reshape(-1)
    if valid.shape[0] != n:
        raise ValueError(f"valid must have {n} entries, got {tuple(valid.shape)}")
    if backend not in (None, "auto", "chunked", "reference"):
        raise ValueError(f"backend must be None, 'auto', 'chunked' or 'reference', got {backend!r}")
    group = tp_group if tp_group is not None and dist.is_initialized() and dist.get_world_size(tp_group) > 1 \
        else None
    if backend == "reference":
        if group is not None:
            raise ValueError("backend='reference' computes one vocabulary shard only (tp_group of size 1)")
        return linear_jsd_reference(hidden, weight, teacher_logits, valid=valid, beta=float(beta),
                                    temperature=temperature, bias=bias)
    ct, cv = default_chunks(n, vs)
    for name, v in (("chunk_tokens", chunk_tokens), ("chunk_vocab", chunk_vocab)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise ValueError(f"{name} must be a positive int or None, got {v!r}")
    idx = valid.nonzero().reshape(-1)
    return LinearJSDFunction.apply(hidden, weight, bias, teacher_logits, idx, float(beta), temperature, group,
                                   bool(reduce_dh), int(chunk_tokens or ct), int(chunk_vocab or cv))
