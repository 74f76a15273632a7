"""Gated DeltaNet ops on the C++ CPU backend (``csrc/gdn``).

The kernels compute in fp32 on contiguous fp32 tensors: bf16/fp16 inputs are converted on
the way in and the output converted back (storage in the caller's dtype, math and
accumulation in fp32). The optional q/k L2 normalisation and the read-out scale are applied
here with torch ops, under autograd, before the C++ chunk kernel; the kernel receives the
normalised, scaled q.

Packed and batched calls share one layout: ``[B, T, ...]`` is flattened to ``[B*T, ...]`` and
treated as B sequences of T tokens (offsets ``0, T, 2T, ...``), so the kernels only know
packed sequences.

Non-finite values: a call with a NaN/Inf input, or whose result is not all finite (a state
that overflowed), is computed by the token-by-token recurrence (:mod:`.reference`) instead. The
chunked form mixes a chunk's tokens through matrix products, where a masked 0 times a NaN/Inf of
a later token is NaN, so one bad token would reach the outputs of earlier ones; and once a value
overflows, where NaN and where +-Inf appear depends on the exact order of the operations, which
only the recurrence reproduces. Finite calls (all of training in practice) pay one isfinite pass
over the inputs and the outputs.

Gradients (``ChunkGatedDeltaRule.backward``): C++ (``gdn_chunk_bwd``), chunk by chunk in
reverse from the chunk-start states saved by the forward, recomputing the in-chunk WY
quantities; gradients flow to q, k, v, g, beta and initial_state, and the final state is
differentiable.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import _alloc, _cpu_ext
from .reference import gated_delta_rule_reference, l2norm


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32).contiguous()


def _offsets(B: int, T: int, cu_seqlens: Optional[torch.Tensor]) -> torch.Tensor:
    if cu_seqlens is not None:
        return cu_seqlens.to(device="cpu", dtype=torch.long).contiguous()
    return torch.arange(0, (B + 1) * T, T, dtype=torch.long) if T > 0 else torch.zeros(B + 1, dtype=torch.long)


def _n_chunks(cu: torch.Tensor, C: int) -> int:
    lengths = cu[1:] - cu[:-1]
    return int(((lengths + C - 1) // C).sum())


class ChunkGatedDeltaRule(torch.autograd.Function):
    """fp32 in, fp32 out: q (normalised and scaled), k [TT, H, K]; v [TT, HV, V]; g, beta [TT, HV];
    h0 [N, HV, K, V] or None; cu [N + 1] int64 (CPU). Returns (o [TT, HV, V], hT [N, HV, K, V])."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, cu, chunk_size):
        TT, H, K = q.shape
        HV, V = v.shape[1], v.shape[2]
        N = cu.numel() - 1
        o = _alloc.empty(TT, HV, V, dtype=torch.float32, device=q.device)
        hT = _alloc.empty(N, HV, K, V, dtype=torch.float32, device=q.device)
        states = _alloc.empty(_n_chunks(cu, chunk_size), HV, K, V, dtype=torch.float32, device=q.device)
        h0c = h0 if h0 is not None else torch.empty(0)
        _cpu_ext.ops().gdn_chunk_fwd(q, k, v, g, beta, h0c, cu, chunk_size, o, hT, states)
        ctx.save_for_backward(q, k, v, g, beta, states, cu)
        ctx.chunk_size = chunk_size
        ctx.has_h0 = h0 is not None
        return o, hT

    @staticmethod
    def backward(ctx, do, dhT):
        q, k, v, g, beta, states, cu = ctx.saved_tensors
        TT, H, K = q.shape
        HV, V = v.shape[1], v.shape[2]
        N = cu.numel() - 1
        do = torch.zeros_like(v) if do is None else _f32(do)
        dhT = torch.empty(0) if dhT is None else _f32(dhT)
        dq = _alloc.empty(TT, HV, K, dtype=torch.float32, device=q.device)
        dk = _alloc.empty(TT, HV, K, dtype=torch.float32, device=q.device)
        dv = _alloc.empty_like(v)
        dg = _alloc.empty_like(g)
        dbeta = _alloc.empty_like(beta)
        dh0 = _alloc.empty(N, HV, K, V, dtype=torch.float32, device=q.device)
        _cpu_ext.ops().gdn_chunk_bwd(q, k, v, g, beta, states, cu, ctx.chunk_size, do, dhT,
                                     dq, dk, dv, dg, dbeta, dh0)
        if HV != H:  # value heads of one GVA group share their key head
            dq = dq.view(TT, H, HV // H, K).sum(2)
            dk = dk.view(TT, H, HV // H, K).sum(2)
        return dq, dk, dv, dg, dbeta, (dh0 if ctx.has_h0 else None), None, None


def _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    qf, kf = q.to(torch.float32), k.to(torch.float32)
    if use_qk_l2norm_in_kernel:
        qf, kf = l2norm(qf), l2norm(kf)
    qf = qf * scale
    flat = (B * T,)
    args = (qf.reshape(*flat, H, K).contiguous(), kf.reshape(*flat, H, K).contiguous(),
            _f32(v).reshape(*flat, HV, V), _f32(g).reshape(*flat, HV), _f32(beta).reshape(*flat, HV),
            None if initial_state is None else _f32(initial_state))
    return args, _offsets(B, T, cu_seqlens)


def _all_finite(*tensors) -> bool:
    return all(t is None or bool(torch.isfinite(t).all()) for t in tensors)


def chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                           cu_seqlens, chunk_size):
    B, T = q.shape[:2]
    HV, V = v.shape[2], v.shape[3]
    recurrence = (q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)
    if not _all_finite(q, k, v, g, beta, initial_state):
        return gated_delta_rule_reference(*recurrence)
    args, cu = _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens)
    o, hT = ChunkGatedDeltaRule.apply(*args, cu, chunk_size)
    o = o.view(B, T, HV, V).to(v.dtype)
    if not _all_finite(o, hT):  # overflowed (o checked after the cast: v's dtype may overflow alone)
        return gated_delta_rule_reference(*recurrence)
    return o, (hT if output_final_state else None)


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                                     use_qk_l2norm_in_kernel, cu_seqlens):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    recurrence = (q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)
    if not _all_finite(q, k, v, g, beta, initial_state):
        with torch.no_grad():
            return gated_delta_rule_reference(*recurrence)
    with torch.no_grad():
        (qf, kf, vf, gf, bf, h0), cu = _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel,
                                                 cu_seqlens)
        o = _alloc.empty(B * T, HV, V, dtype=torch.float32, device=q.device)
        hT = _alloc.empty(cu.numel() - 1, HV, K, V, dtype=torch.float32, device=q.device)
        _cpu_ext.ops().gdn_recurrent_fwd(qf, kf, vf, gf, bf, h0 if h0 is not None else torch.empty(0), cu, o, hT)
        o = o.view(B, T, HV, V).to(v.dtype)
        if not _all_finite(o, hT):  # overflowed: the reference's order of operations decides NaN vs Inf
            return gated_delta_rule_reference(*recurrence)
    return o, (hT if output_final_state else None)


# --- causal conv1d ---------------------------------------------------------------------------------

def _starts(T: int, cu_seqlens: Optional[torch.Tensor]) -> torch.Tensor:
    if cu_seqlens is None:
        return torch.empty(0, dtype=torch.long)
    cu = cu_seqlens.to(device="cpu", dtype=torch.long)
    return torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1], output_size=T).contiguous()


def _conv_backward(dy, xf, wf, bf, starts, silu, dtypes):
    """The conv's gradients from its fp32 inputs: (dx, dweight, dbias or None) in the given dtypes."""
    B, D, T = xf.shape
    dx = _alloc.empty_like(xf)
    dw_rows = _alloc.empty(B, D, wf.shape[1], dtype=torch.float32, device=xf.device)
    db_rows = _alloc.empty(B, D, dtype=torch.float32, device=xf.device)
    _cpu_ext.ops().causal_conv1d_bwd(_f32(dy), xf, wf, bf, starts, silu, dx, dw_rows, db_rows)
    xdt, wdt, bdt = dtypes
    dbias = db_rows.sum(0).to(bdt) if bdt is not None else None
    return dx.to(xdt), dw_rows.sum(0).to(wdt), dbias


class CausalConv1d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, starts, silu):
        xf, wf = _f32(x), _f32(weight)
        bf = _f32(bias) if bias is not None else torch.empty(0)
        y = _alloc.empty_like(xf)
        _cpu_ext.ops().causal_conv1d_fwd(xf, wf, bf, starts, silu, y)
        ctx.save_for_backward(xf, wf, bf, starts)
        ctx.silu = silu
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        xf, wf, bf, starts = ctx.saved_tensors
        return (*_conv_backward(dy, xf, wf, bf, starts, ctx.silu, ctx.dtypes), None, None)


def causal_conv1d_backward(dy, x, weight, bias, activation, cu_seqlens):
    """dy ``[B, D, T]`` -> (dx, dweight, dbias or None) of :func:`causal_conv1d`, from its inputs."""
    bf = _f32(bias) if bias is not None else torch.empty(0)
    return _conv_backward(dy, _f32(x), _f32(weight), bf, _starts(x.shape[2], cu_seqlens), activation == "silu",
                          (x.dtype, weight.dtype, None if bias is None else bias.dtype))


def causal_conv1d(x, weight, bias, activation, cu_seqlens):
    return CausalConv1d.apply(x, weight, bias, _starts(x.shape[2], cu_seqlens), activation == "silu")


def causal_conv1d_update(x, conv_state, weight, bias, activation):
    """One decode step (or a few tokens) with a rolling state; forward only. ``conv_state`` is
    updated in place whatever its dtype and layout (through an fp32 copy when it is not fp32
    contiguous)."""
    squeeze = x.dim() == 2
    x3 = x.unsqueeze(-1) if squeeze else x
    xf, wf = _f32(x3), _f32(weight)
    bf = _f32(bias) if bias is not None else torch.empty(0)
    direct = conv_state.dtype == torch.float32 and conv_state.is_contiguous()
    state = conv_state if direct else conv_state.to(torch.float32).contiguous()
    y = _alloc.empty_like(xf)
    with torch.no_grad():
        _cpu_ext.ops().causal_conv1d_update_fwd(xf, state, wf, bf, activation == "silu", y)
        if not direct:
            conv_state.copy_(state)
    y = y.to(x.dtype)
    return y.squeeze(-1) if squeeze else y

