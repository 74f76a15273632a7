"""Triton forward kernels of the chunked gated delta rule, and the fused recurrent decode kernel.

All sequences are handled in the packed ("varlen") layout: tensors are ``[T_total, heads, dim]``
(batch 1) and ``cu_seqlens`` delimits sequences. A dense ``[B, T]`` call is packed by the
caller as B sequences of length T. Chunk-parallel kernels get one program per (chunk, head)
and read the chunk's sequence and position from ``chunk_idx`` ([n_chunks, 2] int32:
sequence id, chunk id inside the sequence); the state kernels get one program per
(sequence, V-block, value head) and loop over that sequence's chunks.

Per chunk (C tokens, cumulative log-decay ``gc``, chunk-start state ``S`` [K, V]):

    A   = strictly-lower( beta_i * (k_i . k_j) * exp(gc_i - gc_j) )
    Ai  = (I + A)^-1                        (forward substitution)
    w   = Ai @ (beta * exp(gc) * k),  u = Ai @ (beta * v)
    vn  = u - w @ S                         (the per-token delta, "v_new")
    o   = scale * (exp(gc) * (q @ S) + lower-incl((q k^T) * exp(gc_i - gc_j)) @ vn)
    S'  = exp(gc_last) * S + (k * exp(gc_last - gc))^T @ vn

Everything is computed in fp32; ``DOT`` is the ``tl.dot`` input precision ("tf32" for bf16
inputs, whose own rounding is coarser, "ieee" otherwise); the (I + A)^-1 solve is always "ieee".
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def chunk_span(cu_ptr, cidx_ptr, i_c, BT: tl.constexpr):
    """(first token, number of valid tokens) of global chunk ``i_c``."""
    i_n = tl.load(cidx_ptr + i_c * 2)
    i_t = tl.load(cidx_ptr + i_c * 2 + 1)
    bos = tl.load(cu_ptr + i_n).to(tl.int64)
    eos = tl.load(cu_ptr + i_n + 1).to(tl.int64)
    start = bos + i_t.to(tl.int64) * BT
    return start, tl.minimum(eos - start, BT)


@triton.jit
def l2norm_fwd_kernel(x_ptr, y_ptr, r_ptr, n_rows, D, eps, BR: tl.constexpr, BD: tl.constexpr):
    """y = x / sqrt(sum(x^2) + eps) over rows of length D; r = 1 / sqrt(...) kept for backward."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    m = (rows[:, None] < n_rows) & (cols[None, :] < D)
    off = rows[:, None].to(tl.int64) * D + cols[None, :]
    x = tl.load(x_ptr + off, mask=m, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, 1) + eps)
    tl.store(y_ptr + off, x * r[:, None], mask=m)
    tl.store(r_ptr + rows, r, mask=rows < n_rows)


@triton.jit
def l2norm_bwd_kernel(y_ptr, r_ptr, dy_ptr, dx_ptr, n_rows, D, BR: tl.constexpr, BD: tl.constexpr):
    """dx = r * (dy - y * sum(y * dy)), the exact gradient of y = x * r(x)."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    m = (rows[:, None] < n_rows) & (cols[None, :] < D)
    off = rows[:, None].to(tl.int64) * D + cols[None, :]
    y = tl.load(y_ptr + off, mask=m, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + off, mask=m, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + rows, mask=rows < n_rows, other=0.0)
    dx = r[:, None] * (dy - y * tl.sum(y * dy, 1)[:, None])
    tl.store(dx_ptr + off, dx.to(dx_ptr.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["H", "HV", "K", "V"])
def prep_fwd_kernel(k_ptr, v_ptr, g_ptr, beta_ptr, gc_ptr, ai_ptr, w_ptr, u_ptr, cu_ptr, cidx_ptr,
                    H, HV, K, V,
                    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DOT: tl.constexpr,
                    LOG_BT: tl.constexpr, SOLVE: tl.constexpr):
    """Per (chunk, value head): gc, Ai = (I + A)^-1, w and u (all fp32)."""
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)
    start, nv = chunk_span(cu_ptr, cidx_ptr, i_c, BT)
    rows = tl.arange(0, BT)
    rm = rows < nv
    tok = start + rows
    g = tl.load(g_ptr + tok * HV + i_hv, mask=rm, other=0.0).to(tl.float32)
    gc = tl.cumsum(g, 0)
    tl.store(gc_ptr + tok * HV + i_hv, gc, mask=rm)
    beta = tl.load(beta_ptr + tok * HV + i_hv, mask=rm, other=0.0).to(tl.float32)
    ck = tl.arange(0, BK)
    k = tl.load(k_ptr + tok[:, None] * (H * K) + i_h * K + ck[None, :],
                mask=rm[:, None] & (ck[None, :] < K), other=0.0).to(tl.float32)

    lower = rows[:, None] > rows[None, :]
    kk = tl.dot(k, tl.trans(k), input_precision=DOT)
    decay = tl.exp(tl.where(lower, gc[:, None] - gc[None, :], 0.0))
    a = tl.where(lower, beta[:, None] * kk * decay, 0.0)
    # (I + A)^-1 by blocked forward substitution, doubling the solved block size each level:
    # with Ai block-diagonal in s-blocks, each 2s-block [[L1, 0], [C, L2]] has the inverse
    # [[L1^-1, 0], [-L2^-1 C L1^-1, L2^-1]], i.e. Ai <- Ai - Ai @ C @ Ai with C the lower-left
    # s-blocks of A. Ten BT^3 dots for BT = 64, instead of a 63-step row loop.
    same2 = (rows[:, None] // 2) == (rows[None, :] // 2)
    ai = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0) - tl.where(same2, a, 0.0)
    for lvl in tl.static_range(1, LOG_BT):
        blk = (rows[:, None] // (2 << lvl)) == (rows[None, :] // (2 << lvl))
        off = (rows[:, None] // (1 << lvl)) != (rows[None, :] // (1 << lvl))
        c = tl.where(blk & off, a, 0.0)
        ai = ai - tl.dot(tl.dot(ai, c, input_precision=SOLVE), ai, input_precision=SOLVE)
    tl.store(ai_ptr + tok[:, None] * (HV * BT) + i_hv * BT + rows[None, :], ai, mask=rm[:, None])

    kb = k * (beta * tl.exp(gc))[:, None]
    w = tl.dot(ai, kb, input_precision=DOT)
    tl.store(w_ptr + tok[:, None] * (HV * K) + i_hv * K + ck[None, :], w,
             mask=rm[:, None] & (ck[None, :] < K))
    for i_v in range(0, tl.cdiv(V, BV)):
        cv = i_v * BV + tl.arange(0, BV)
        mv = rm[:, None] & (cv[None, :] < V)
        v = tl.load(v_ptr + tok[:, None] * (HV * V) + i_hv * V + cv[None, :], mask=mv, other=0.0).to(tl.float32)
        u = tl.dot(ai, v * beta[:, None], input_precision=DOT)
        tl.store(u_ptr + tok[:, None] * (HV * V) + i_hv * V + cv[None, :], u, mask=mv)


@triton.jit(do_not_specialize=["H", "HV", "K", "V"])
def state_fwd_kernel(k_ptr, w_ptr, u_ptr, gc_ptr, h_ptr, vn_ptr, h0_ptr, ht_ptr, cu_ptr, coff_ptr,
                     H, HV, K, V,
                     BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, DOT: tl.constexpr):
    """Per (sequence, V-block, value head): walk the chunks, saving each chunk-start state and vn."""
    i_n = tl.program_id(0)
    i_v = tl.program_id(1)
    i_hv = tl.program_id(2)
    i_h = i_hv // (HV // H)
    bos = tl.load(cu_ptr + i_n).to(tl.int64)
    eos = tl.load(cu_ptr + i_n + 1).to(tl.int64)
    c0 = tl.load(coff_ptr + i_n).to(tl.int64)
    nt = tl.cdiv(eos - bos, BT)
    rows = tl.arange(0, BT)
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    mkv = (ck[:, None] < K) & (cv[None, :] < V)
    s_off = ck[:, None] * V + cv[None, :]
    st_base = (i_n * HV + i_hv).to(tl.int64) * (K * V)
    if HAS_H0:
        b_h = tl.load(h0_ptr + st_base + s_off, mask=mkv, other=0.0).to(tl.float32)
    else:
        b_h = tl.zeros([BK, BV], dtype=tl.float32)
    for it in range(0, nt):
        start = bos + it * BT
        nv = tl.minimum(eos - start, BT)
        rm = rows < nv
        tok = start + rows
        tl.store(h_ptr + ((c0 + it) * HV + i_hv) * (K * V) + s_off, b_h, mask=mkv)
        mk = rm[:, None] & (ck[None, :] < K)
        mv = rm[:, None] & (cv[None, :] < V)
        w = tl.load(w_ptr + tok[:, None] * (HV * K) + i_hv * K + ck[None, :], mask=mk, other=0.0)
        u = tl.load(u_ptr + tok[:, None] * (HV * V) + i_hv * V + cv[None, :], mask=mv, other=0.0)
        vn = u - tl.dot(w, b_h, input_precision=DOT)
        tl.store(vn_ptr + tok[:, None] * (HV * V) + i_hv * V + cv[None, :], vn, mask=mv)
        gc = tl.load(gc_ptr + tok * HV + i_hv, mask=rm, other=0.0)
        g_last = tl.load(gc_ptr + (start + nv - 1) * HV + i_hv)
        k = tl.load(k_ptr + tok[:, None] * (H * K) + i_h * K + ck[None, :], mask=mk, other=0.0).to(tl.float32)
        kd = k * tl.exp(g_last - gc)[:, None]
        b_h = b_h * tl.exp(g_last) + tl.dot(tl.trans(kd), vn, input_precision=DOT)
    if STORE_HT:
        tl.store(ht_ptr + st_base + s_off, b_h, mask=mkv)


@triton.jit(do_not_specialize=["H", "HV", "K", "V"])
def output_fwd_kernel(q_ptr, k_ptr, vn_ptr, gc_ptr, h_ptr, o_ptr, cu_ptr, cidx_ptr, scale,
                      H, HV, K, V,
                      BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DOT: tl.constexpr):
    """o = scale * (exp(gc) * (q @ S) + causal((q k^T) * decay) @ vn), per (chunk, V-block, value head)."""
    i_c = tl.program_id(0)
    i_v = tl.program_id(1)
    i_hv = tl.program_id(2)
    i_h = i_hv // (HV // H)
    start, nv = chunk_span(cu_ptr, cidx_ptr, i_c, BT)
    rows = tl.arange(0, BT)
    rm = rows < nv
    tok = start + rows
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    mk = rm[:, None] & (ck[None, :] < K)
    mv = rm[:, None] & (cv[None, :] < V)
    q = tl.load(q_ptr + tok[:, None] * (H * K) + i_h * K + ck[None, :], mask=mk, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + tok[:, None] * (H * K) + i_h * K + ck[None, :], mask=mk, other=0.0).to(tl.float32)
    s = tl.load(h_ptr + (i_c.to(tl.int64) * HV + i_hv) * (K * V) + ck[:, None] * V + cv[None, :],
                mask=(ck[:, None] < K) & (cv[None, :] < V), other=0.0)
    vn = tl.load(vn_ptr + tok[:, None] * (HV * V) + i_hv * V + cv[None, :], mask=mv, other=0.0)
    gc = tl.load(gc_ptr + tok * HV + i_hv, mask=rm, other=0.0)
    causal = rows[:, None] >= rows[None, :]
    qk = tl.dot(q, tl.trans(k), input_precision=DOT)
    qk = tl.where(causal, qk * tl.exp(tl.where(causal, gc[:, None] - gc[None, :], 0.0)), 0.0)
    o = tl.dot(q, s, input_precision=DOT) * tl.exp(gc)[:, None] + tl.dot(qk, vn, input_precision=DOT)
    tl.store(o_ptr + tok[:, None] * (HV * V) + i_hv * V + cv[None, :], (o * scale).to(o_ptr.dtype.element_ty),
             mask=mv)


@triton.jit(do_not_specialize=["H", "HV", "K", "V"])
def fused_recurrent_fwd_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, h0_ptr, ht_ptr, cu_ptr, scale,
                               H, HV, K, V,
                               BK: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr,
                               STORE_HT: tl.constexpr, L2NORM: tl.constexpr):
    """Token-by-token recurrence per (sequence, V-block, value head); the state stays in registers."""
    i_n = tl.program_id(0)
    i_v = tl.program_id(1)
    i_hv = tl.program_id(2)
    i_h = i_hv // (HV // H)
    bos = tl.load(cu_ptr + i_n).to(tl.int64)
    eos = tl.load(cu_ptr + i_n + 1).to(tl.int64)
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    mk = ck < K
    mv = cv < V
    mkv = mk[:, None] & mv[None, :]
    s_off = ck[:, None] * V + cv[None, :]
    st_base = (i_n * HV + i_hv).to(tl.int64) * (K * V)
    if HAS_H0:
        b_h = tl.load(h0_ptr + st_base + s_off, mask=mkv, other=0.0).to(tl.float32)
    else:
        b_h = tl.zeros([BK, BV], dtype=tl.float32)
    for it in range(0, eos - bos):
        t = bos + it
        q = tl.load(q_ptr + t * (H * K) + i_h * K + ck, mask=mk, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t * (H * K) + i_h * K + ck, mask=mk, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t * (HV * V) + i_hv * V + cv, mask=mv, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + t * HV + i_hv).to(tl.float32)
        beta = tl.load(beta_ptr + t * HV + i_hv).to(tl.float32)
        if L2NORM:
            q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6)
            k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
        b_h = b_h * tl.exp(g)
        delta = (v - tl.sum(b_h * k[:, None], 0)) * beta
        b_h = b_h + k[:, None] * delta[None, :]
        o = tl.sum(b_h * q[:, None], 0) * scale
        tl.store(o_ptr + t * (HV * V) + i_hv * V + cv, o.to(o_ptr.dtype.element_ty), mask=mv)
    if STORE_HT:
        tl.store(ht_ptr + st_base + s_off, b_h, mask=mkv)
