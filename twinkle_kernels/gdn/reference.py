"""Readable pure-torch references of the Gated DeltaNet ops: the ground truth.

The gated delta rule is written as the plain token-by-token recurrence; per value
head, with the state ``S: [K, V]``::

    S   = S * exp(g_t)                              # decay (g is log-space, <= 0 in practice)
    S   = S + beta_t * k_t (v_t - S^T k_t)^T        # delta-rule write
    o_t = scale * S^T q_t

Value head ``j`` reads key head ``j // (HV // H)`` (GVA, as ``repeat_interleave``). Math
runs in float64 for float64 inputs and in fp32 otherwise; gradients come from autograd
through the loop. This is the same recurrence as transformers'
``torch_recurrent_gated_delta_rule`` (and its l2norm: ``x * rsqrt(sum(x**2) + 1e-6)``).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from .._dtypes import compute_dtype

L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x**2, -1) + eps)`` (fla's and transformers' qk normalisation)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def sequence_bounds(T: int, B: int, cu_seqlens: Optional[torch.Tensor]) -> List[Tuple[int, int, int]]:
    """``(batch row, start, end)`` of every sequence: B rows of T tokens, or the packed pieces."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    cu = [int(c) for c in cu_seqlens.tolist()]
    return [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


def gated_delta_rule_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, scale: Optional[float] = None,
                               initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
                               use_qk_l2norm_in_kernel: bool = False,
                               cu_seqlens: Optional[torch.Tensor] = None):
    """Token-by-token gated delta rule.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]`` with ``HV % H == 0``; g, beta: ``[B, T, HV]``.
        scale: multiplies the read-out; default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (N = B, or the number of packed sequences).
        cu_seqlens: ``[N + 1]`` integer offsets of packed sequences (B must be 1).

    Returns ``(o [B, T, HV, V] in v.dtype, final_state [N, HV, K, V] or None)``; the state is
    fp32 (float64 when the inputs are float64).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    ct = compute_dtype(v.dtype)
    scale = K ** -0.5 if scale is None else float(scale)
    qf, kf = q.to(ct), k.to(ct)
    if use_qk_l2norm_in_kernel:
        qf, kf = l2norm(qf), l2norm(kf)
    if HV != H:
        qf = qf.repeat_interleave(HV // H, dim=2)
        kf = kf.repeat_interleave(HV // H, dim=2)
    vf, gf, bf = v.to(ct), g.to(ct), beta.to(ct)

    # One pass per group of rows that share a time span: all B rows at once, or one packed sequence.
    if cu_seqlens is None:
        groups = [(slice(0, B), 0, T, slice(0, B))]
    else:
        bounds = sequence_bounds(T, B, cu_seqlens)
        groups = [(slice(0, 1), s, e, slice(n, n + 1)) for n, (_, s, e) in enumerate(bounds)]
    pieces, finals = [], []
    for rows, s, e, states in groups:
        if initial_state is not None:
            S = initial_state[states].to(ct)
        else:
            S = torch.zeros(vf[rows].shape[0], HV, K, V, dtype=ct, device=v.device)
        decay = gf[rows, s:e].exp().unbind(1)
        steps = zip(qf[rows, s:e].unbind(1), kf[rows, s:e].unbind(1), vf[rows, s:e].unbind(1), decay,
                    bf[rows, s:e].unbind(1))
        outs = []
        for qt, kt, vt, dt, bt in steps:  # [b, HV, K], [b, HV, K], [b, HV, V], [b, HV], [b, HV]
            S = S * dt[..., None, None]
            pred = (S * kt[..., None]).sum(-2)
            S = S + kt[..., None] * (bt[..., None] * (vt - pred))[..., None, :]
            outs.append(scale * (S * qt[..., None]).sum(-2))
        pieces.append(torch.stack(outs, 1) if outs else vf.new_zeros(S.shape[0], 0, HV, V))
        finals.append(S)
    o = torch.cat(pieces, 1).to(v.dtype)
    final = torch.cat(finals, 0) if output_final_state else None
    if final is not None and ct != torch.float64:
        final = final.to(torch.float32)
    return o, final


# --- causal conv1d -------------------------------------------------------------------------------

def _activate(y: torch.Tensor, activation: Optional[str]) -> torch.Tensor:
    if activation is None:
        return y
    return F.silu(y)


def _sequence_starts(T: int, cu_seqlens: Optional[torch.Tensor], device) -> Optional[torch.Tensor]:
    """For every token position, the position its sequence starts at (None: one sequence per row)."""
    if cu_seqlens is None:
        return None
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    lengths = cu[1:] - cu[:-1]
    return torch.repeat_interleave(cu[:-1], lengths, output_size=T)


def causal_conv1d_reference(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                            activation: Optional[str] = "silu",
                            cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Depthwise causal convolution, transformers' ``causal_conv1d_fn`` semantics.

    ``y[b, d, t] = act(bias[d] + sum_i weight[d, i] * x[b, d, t - (W - 1) + i])`` where positions
    before the start of the token's sequence read zero.

    Args:
        x: ``[B, D, T]``; weight: ``[D, W]``; bias: ``[D]`` or None; activation: None or "silu".
        cu_seqlens: ``[N + 1]`` packed-sequence offsets along T (B must be 1).

    Returns ``[B, D, T]`` in x.dtype (math in fp32, or float64 for float64 x).
    """
    ct = compute_dtype(x.dtype)
    B, D, T = x.shape
    W = weight.shape[1]
    xf, wf = x.to(ct), weight.to(ct)
    starts = _sequence_starts(T, cu_seqlens, x.device)
    pos = torch.arange(T, device=x.device)
    xp = F.pad(xf, (W - 1, 0))
    y = torch.zeros(B, D, T, dtype=ct, device=x.device)
    for i in range(W):
        shift = W - 1 - i  # tap i reads x[t - shift]
        term = xp[:, :, i:i + T] * wf[:, i, None]
        if starts is not None and shift > 0:
            # where, not a multiply by the mask: an Inf in one sequence times 0 would be NaN in the next
            term = torch.where(pos - shift >= starts, term, term.new_zeros(()))
        y = y + term
    if bias is not None:
        y = y + bias.to(ct)[:, None]
    return _activate(y, activation).to(x.dtype)


def causal_conv1d_update_reference(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                                   bias: Optional[torch.Tensor] = None,
                                   activation: Optional[str] = None) -> torch.Tensor:
    """One decode step (or a few tokens) of the causal conv with a rolling state.

    transformers' ``causal_conv1d_update`` semantics: the window is
    ``cat(conv_state, x)`` along time; the output is the last S positions of the causal conv
    over it, and ``conv_state`` is overwritten **in place** with the last L columns of the window.

    Args:
        x: ``[B, D, S]`` (or ``[B, D]`` for one token); conv_state: ``[B, D, L]`` with ``L >= W - 1``;
        weight: ``[D, W]``; bias: ``[D]`` or None; activation: None or "silu".

    Returns ``[B, D, S]`` (``[B, D]`` for 2-D x) in x.dtype.
    """
    squeeze = x.dim() == 2
    if squeeze:
        x = x.unsqueeze(-1)
    ct = compute_dtype(x.dtype)
    S, L, W = x.shape[-1], conv_state.shape[-1], weight.shape[1]
    window = torch.cat([conv_state.to(ct), x.to(ct)], dim=-1)
    with torch.no_grad():
        # the last L of L + S columns; window[:, :, -L:] would be all of them for L == 0
        conv_state.copy_(window[:, :, S:].to(conv_state.dtype))
    wf = weight.to(ct)
    y = torch.zeros(x.shape[0], x.shape[1], S, dtype=ct, device=x.device)
    total = L + S
    for i in range(W):
        shift = W - 1 - i
        y = y + window[:, :, total - S - shift: total - shift] * wf[:, i, None]
    if bias is not None:
        y = y + bias.to(ct)[:, None]
    y = _activate(y, activation).to(x.dtype)
    return y.squeeze(-1) if squeeze else y
