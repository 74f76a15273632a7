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

Kernels: ``prep_fwd_kernel`` (gc, Ai), ``wu_fwd_kernel`` (w, u), ``state_fwd_kernel`` (the
sequential walk: h, vn, final state), ``output_fwd_kernel`` (o). K and V are walked in blocks of
at most 64 channels, so a program holds a few ``[64, 64]`` tiles (the state kernel a ``[K, BV]``
fp32 state with ``K * BV <= 4096``), within the registers of one warpgroup.

Precision: ``tl.dot`` operands follow the constexpr ``OPD`` (bf16/fp16 operands for bf16/fp16
inputs, see :mod:`._triton_common`), always with fp32 accumulation. Kept wider on purpose:
``gc`` (the in-chunk cumulative log-decay) is fp64, because its differences are what enter
``exp`` and fp32 would lose them once ``|gc|`` reaches the thousands; the running states, ``u``
and every elementwise step are fp32; the ``(I + A)^-1`` solve runs in fp32 FMAs.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._triton_common import (chunk_span, decay_diff, mm, mm_acc, opnd, rows_block, state_block_load,
                             state_block_store)


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


@triton.jit
def prep_fwd_kernel(k_ptr, g_ptr, beta_ptr, gc_ptr, ai_ptr, cu_ptr, cidx_ptr,
                    H, HV, K,
                    BT: tl.constexpr, BK: tl.constexpr, OPD: tl.constexpr):
    """Per (chunk, value head): gc (fp64) and Ai = (I + A)^-1; K in BK blocks."""
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)
    start, nv = chunk_span(cu_ptr, cidx_ptr, i_c, BT)
    rows = tl.arange(0, BT)
    rm = rows < nv
    # per-token offsets stay int32 against int64 chunk bases: 64-bit offset tiles cost registers
    tv = start * HV + i_hv + rows * HV
    g = tl.load(g_ptr + tv, mask=rm, other=0.0).to(tl.float32)
    # fp64: after a strong decay |gc| reaches thousands, where fp32 differences gc_i - gc_j
    # would keep only ~1e-4 absolute (relative, after exp) accuracy.
    gc = tl.cumsum(g.to(tl.float64), 0)
    tl.store(gc_ptr + tv, gc, mask=rm)
    beta = tl.load(beta_ptr + tv, mask=rm, other=0.0).to(tl.float32)
    k_blk = k_ptr + start * (H * K) + i_h * K + rows[:, None] * (H * K)
    kk = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        ck = i_k * BK + tl.arange(0, BK)
        kb = tl.load(k_blk + ck[None, :], mask=rm[:, None] & (ck[None, :] < K), other=0.0)
        kk = mm_acc(kb, tl.trans(kb), kk, OPD)
    lower = rows[:, None] > rows[None, :]
    a = beta[:, None] * kk * decay_diff(gc, gc, lower)
    # (I + A)^-1 by forward substitution, one row per step, with fp32 FMAs whatever the operand
    # precision (the inverse feeds every later step; it is rounded once, when it is stored):
    # row i of Ai is e_i - sum_p A[i, p] Ai[p, :], and the rows p >= i still being identity rows
    # does not matter since A[i, p] = 0 there. No dots: a 64x64x64 product with fp32 accuracy
    # (FMA or 3xTF32) holds more operand registers than the whole step needs.
    at = tl.trans(a)                                    # at[p, i] = A[i, p]
    ai = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    for i in range(1, nv):
        a_i = tl.sum(tl.where(rows[None, :] == i, at, 0.0), 1)
        r = tl.where(rows == i, 1.0, 0.0) - tl.sum(a_i[:, None] * ai, 0)
        ai = tl.where(rows[:, None] == i, r[None, :], ai)
    ai = opnd(ai, OPD)
    tl.store(ai_ptr + (start * HV + i_hv) * BT + rows[:, None] * (HV * BT) + rows[None, :],
             ai.to(ai_ptr.dtype.element_ty), mask=rm[:, None])


@triton.jit
def wu_fwd_kernel(k_ptr, v_ptr, beta_ptr, gc_ptr, ai_ptr, w_ptr, u_ptr, cu_ptr, cidx_ptr,
                  H, HV, K, V,
                  BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, OPD: tl.constexpr):
    """Per (chunk, value head): w = Ai @ (beta exp(gc) k), u = Ai @ (beta v); K, V in blocks."""
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)
    start, nv = chunk_span(cu_ptr, cidx_ptr, i_c, BT)
    rows = tl.arange(0, BT)
    rm = rows < nv
    tv = start * HV + i_hv
    gc = tl.load(gc_ptr + tv + rows * HV, mask=rm, other=0.0)
    beta = tl.load(beta_ptr + tv + rows * HV, mask=rm, other=0.0).to(tl.float32)
    ai = tl.load(ai_ptr + tv * BT + rows[:, None] * (HV * BT) + rows[None, :], mask=rm[:, None], other=0.0)
    eb = beta * tl.exp(gc.to(tl.float32))
    k_blk = k_ptr + start * (H * K) + i_h * K + rows[:, None] * (H * K)
    w_blk = w_ptr + tv * K + rows[:, None] * (HV * K)
    for i_k in range(0, tl.cdiv(K, BK)):
        ck = i_k * BK + tl.arange(0, BK)
        mk = rm[:, None] & (ck[None, :] < K)
        kb = tl.load(k_blk + ck[None, :], mask=mk, other=0.0).to(tl.float32)
        w = opnd(mm(ai, kb * eb[:, None], OPD), OPD)
        tl.store(w_blk + ck[None, :], w.to(w_ptr.dtype.element_ty), mask=mk)
    v_blk = tv * V + rows[:, None] * (HV * V)
    for i_v in range(0, tl.cdiv(V, BV)):
        cv = i_v * BV + tl.arange(0, BV)
        mv = rm[:, None] & (cv[None, :] < V)
        vb = tl.load(v_ptr + v_blk + cv[None, :], mask=mv, other=0.0).to(tl.float32)
        u = mm(ai, vb * beta[:, None], OPD)
        tl.store(u_ptr + v_blk + cv[None, :], u, mask=mv)


@triton.jit
def _fwd_read(b_h, h_ptr, h_base, w_ptr, w_base, i_k: tl.constexpr, rows, rm, cv, K, V, HV, wh,
              BK: tl.constexpr, OPD: tl.constexpr):
    """Save one K-block of the chunk-start state (rounded to OPD) and add its ``w @ S`` part to wh."""
    h_op = opnd(b_h, OPD)
    state_block_store(h_ptr, h_base, i_k, cv, K, V, h_op, BK)
    return mm_acc(rows_block(w_ptr, w_base, i_k, rows, rm, K, HV * K, BK), h_op, wh, OPD)


@triton.jit
def _fwd_step(b_h, k_ptr, k_base, i_k: tl.constexpr, rows, rm, K, H, e_row, e_last, vn,
              BK: tl.constexpr, OPD: tl.constexpr):
    """One K-block of S' = exp(g_last) S + (k * exp(g_last - gc))^T @ vn."""
    kd = rows_block(k_ptr, k_base, i_k, rows, rm, K, H * K, BK).to(tl.float32) * e_row[:, None]
    return mm_acc(tl.trans(kd), vn, b_h * e_last, OPD)


@triton.jit
def state_fwd_kernel(k_ptr, w_ptr, u_ptr, gc_ptr, h_ptr, vn_ptr, h0_ptr, ht_ptr, cu_ptr, coff_ptr,
                     H, HV, K, V,
                     BT: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr, BV: tl.constexpr,
                     HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, OPD: tl.constexpr):
    """Per (sequence, V-block, value head): walk the chunks, saving each chunk-start state and vn.
    The running state stays fp32 in registers as NK <= 4 separate ``[BK, BV]`` blocks of K (a
    tile cannot be sliced, and one ``[K, BV]`` tile would make every dot K deep); what is saved
    is rounded to ``OPD``."""
    i_n = tl.program_id(0)
    i_v = tl.program_id(1)
    i_hv = tl.program_id(2)
    i_h = i_hv // (HV // H)
    bos = tl.load(cu_ptr + i_n).to(tl.int64)
    eos = tl.load(cu_ptr + i_n + 1).to(tl.int64)
    c0 = tl.load(coff_ptr + i_n).to(tl.int64)
    nt = tl.cdiv(eos - bos, BT)
    rows = tl.arange(0, BT)
    cv = i_v * BV + tl.arange(0, BV)
    v_off = rows[:, None] * (HV * V) + cv[None, :]
    st_base = (i_n * HV + i_hv).to(tl.int64) * (K * V)
    b_h1 = state_block_load(h0_ptr, st_base, 0, cv, K, V, BK, HAS_H0, BV)
    if NK > 1:
        b_h2 = state_block_load(h0_ptr, st_base, 1, cv, K, V, BK, HAS_H0, BV)
    if NK > 2:
        b_h3 = state_block_load(h0_ptr, st_base, 2, cv, K, V, BK, HAS_H0, BV)
    if NK > 3:
        b_h4 = state_block_load(h0_ptr, st_base, 3, cv, K, V, BK, HAS_H0, BV)
    for it in range(0, nt):
        start = bos + it * BT
        nv = tl.minimum(eos - start, BT)
        rm = rows < nv
        mv = rm[:, None] & (cv[None, :] < V)
        tv = start * HV + i_hv
        h_base = ((c0 + it) * HV + i_hv) * (K * V)
        wh = tl.zeros([BT, BV], dtype=tl.float32)
        wh = _fwd_read(b_h1, h_ptr, h_base, w_ptr, tv * K, 0, rows, rm, cv, K, V, HV, wh, BK, OPD)
        if NK > 1:
            wh = _fwd_read(b_h2, h_ptr, h_base, w_ptr, tv * K, 1, rows, rm, cv, K, V, HV, wh, BK, OPD)
        if NK > 2:
            wh = _fwd_read(b_h3, h_ptr, h_base, w_ptr, tv * K, 2, rows, rm, cv, K, V, HV, wh, BK, OPD)
        if NK > 3:
            wh = _fwd_read(b_h4, h_ptr, h_base, w_ptr, tv * K, 3, rows, rm, cv, K, V, HV, wh, BK, OPD)
        u = tl.load(u_ptr + tv * V + v_off, mask=mv, other=0.0)
        vn = opnd(u - wh, OPD)
        tl.store(vn_ptr + tv * V + v_off, vn.to(vn_ptr.dtype.element_ty), mask=mv)
        gc = tl.load(gc_ptr + tv + rows * HV, mask=rm, other=0.0)
        g_last = tl.load(gc_ptr + tv + (nv - 1) * HV)
        e_row = tl.exp((g_last - gc).to(tl.float32))
        e_last = tl.exp(g_last.to(tl.float32))
        k_base = start * (H * K) + i_h * K
        b_h1 = _fwd_step(b_h1, k_ptr, k_base, 0, rows, rm, K, H, e_row, e_last, vn, BK, OPD)
        if NK > 1:
            b_h2 = _fwd_step(b_h2, k_ptr, k_base, 1, rows, rm, K, H, e_row, e_last, vn, BK, OPD)
        if NK > 2:
            b_h3 = _fwd_step(b_h3, k_ptr, k_base, 2, rows, rm, K, H, e_row, e_last, vn, BK, OPD)
        if NK > 3:
            b_h4 = _fwd_step(b_h4, k_ptr, k_base, 3, rows, rm, K, H, e_row, e_last, vn, BK, OPD)
    if STORE_HT:
        state_block_store(ht_ptr, st_base, 0, cv, K, V, b_h1, BK)
        if NK > 1:
            state_block_store(ht_ptr, st_base, 1, cv, K, V, b_h2, BK)
        if NK > 2:
            state_block_store(ht_ptr, st_base, 2, cv, K, V, b_h3, BK)
        if NK > 3:
            state_block_store(ht_ptr, st_base, 3, cv, K, V, b_h4, BK)


@triton.jit
def output_fwd_kernel(q_ptr, k_ptr, vn_ptr, gc_ptr, h_ptr, o_ptr, cu_ptr, cidx_ptr, scale,
                      H, HV, K, V,
                      BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, OPD: tl.constexpr):
    """o = scale * (exp(gc) * (q @ S) + causal((q k^T) * decay) @ vn), per (chunk, V-block, value head),
    K in BK blocks."""
    i_c = tl.program_id(0)
    i_v = tl.program_id(1)
    i_hv = tl.program_id(2)
    i_h = i_hv // (HV // H)
    start, nv = chunk_span(cu_ptr, cidx_ptr, i_c, BT)
    rows = tl.arange(0, BT)
    rm = rows < nv
    cv = i_v * BV + tl.arange(0, BV)
    mv = rm[:, None] & (cv[None, :] < V)
    qk_blk = start * (H * K) + i_h * K + rows[:, None] * (H * K)
    s_base = h_ptr + (i_c.to(tl.int64) * HV + i_hv) * (K * V)
    qk = tl.zeros([BT, BT], dtype=tl.float32)
    o = tl.zeros([BT, BV], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        ck = i_k * BK + tl.arange(0, BK)
        mk = rm[:, None] & (ck[None, :] < K)
        q = tl.load(q_ptr + qk_blk + ck[None, :], mask=mk, other=0.0)
        k = tl.load(k_ptr + qk_blk + ck[None, :], mask=mk, other=0.0)
        s = tl.load(s_base + ck[:, None] * V + cv[None, :], mask=(ck[:, None] < K) & (cv[None, :] < V), other=0.0)
        qk = mm_acc(q, tl.trans(k), qk, OPD)
        o = mm_acc(q, s, o, OPD)
    tv = start * HV + i_hv
    gc = tl.load(gc_ptr + tv + rows * HV, mask=rm, other=0.0)
    qk = qk * decay_diff(gc, gc, rows[:, None] >= rows[None, :])
    v_blk = tv * V + rows[:, None] * (HV * V) + cv[None, :]
    vn = tl.load(vn_ptr + v_blk, mask=mv, other=0.0)
    o = mm_acc(qk, vn, o * tl.exp(gc.to(tl.float32))[:, None], OPD)
    tl.store(o_ptr + v_blk, (o * scale).to(o_ptr.dtype.element_ty), mask=mv)


@triton.jit
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
