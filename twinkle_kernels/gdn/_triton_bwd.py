"""Triton backward kernels of the chunked gated delta rule.

Notation as in :mod:`._triton_fwd`. The forward saves, per chunk, the chunk-start states
``h`` (``S``), ``gc``, ``Ai``, ``w`` and ``vn``; the backward runs:

1. ``dvn_local_kernel``: per chunk, the intra-chunk parts: ``dvl = scale * causal(q k^T * decay)^T @ dO``
   (the local part of dvn), and through ``dA_qk = scale * (dO @ vn^T) * decay`` the first parts of
   dq, dk and d(gc).
2. ``state_bwd_kernel``: walks each sequence's chunks backwards carrying ``dS'`` (the gradient
   of the chunk-end state), saving it per chunk as ``dh``, completing
   ``dvn = dvl + (k * exp(gc_last - gc)) @ dS'`` and stepping
   ``dS = exp(gc_last) dS' + scale (q exp(gc))^T dO - w^T dvn``. What is left at the start is
   the gradient of the initial state.
3. ``dqk_bwd_kernel``: per (K-block, chunk), the parts that go through the states: dq (final),
   dw, and more of dk and d(gc) (one d(gc) partial per K-block).
4. ``wy_bwd_kernel``: back through ``w = Ai kb``, ``u = Ai vb`` and ``Ai = (I + A)^-1``
   (``dA = -Ai^T dAi Ai^T``), giving dv, dbeta, the rest of dk and d(gc), then dg as the
   reverse cumulative sum of d(gc) inside the chunk (in fp64).

Every kernel holds at most a few ``[BT, 64]`` / ``[BT, BT]`` fp32 tiles: K and V are walked in
blocks, and what crosses kernels goes through global memory, so no kernel spills registers.
Dot operands follow ``OPD`` (see :mod:`._triton_common`); accumulations are fp32.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._triton_common import (chunk_span, decay_diff, mm, mm_acc, opnd, rows_block, state_block_load,
                             state_block_store)


@triton.jit(do_not_specialize=["T"])
def dvn_local_kernel(q_ptr, k_ptr, gc_ptr, do_ptr, vn_ptr, dvl_ptr, dq_ptr, dk_ptr, dgcp_ptr, cu_ptr, cidx_ptr,
                     scale, T, H, HV, K, V,
                     BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, OPD: tl.constexpr):
    """Per (chunk, value head): dvl, and the intra-chunk parts of dq, dk (written first) and d(gc)
    (slot 0 of the d(gc) partials)."""
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)
    start, nv = chunk_span(cu_ptr, cidx_ptr, i_c, BT)
    rows = tl.arange(0, BT)
    rm = rows < nv
    tv = start * HV + i_hv
    qk_blk = start * (H * K) + i_h * K + rows[:, None] * (H * K)
    kv_blk = tv * K + rows[:, None] * (HV * K)
    v_blk = tv * V + rows[:, None] * (HV * V)
    qk = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        ck = i_k * BK + tl.arange(0, BK)
        mk = rm[:, None] & (ck[None, :] < K)
        q = tl.load(q_ptr + qk_blk + ck[None, :], mask=mk, other=0.0)
        k = tl.load(k_ptr + qk_blk + ck[None, :], mask=mk, other=0.0)
        qk = mm_acc(q, tl.trans(k), qk, OPD)
    gc = tl.load(gc_ptr + tv + rows * HV, mask=rm, other=0.0)
    causal = rows[:, None] >= rows[None, :]
    aqk = qk * decay_diff(gc, gc, causal)            # A_qk[i, j] = (q_i . k_j) exp(gc_i - gc_j), j <= i
    dqk = tl.zeros([BT, BT], dtype=tl.float32)        # dO @ vn^T
    for i_v in range(0, tl.cdiv(V, BV)):
        cv = i_v * BV + tl.arange(0, BV)
        mv = rm[:, None] & (cv[None, :] < V)
        do = tl.load(do_ptr + v_blk + cv[None, :], mask=mv, other=0.0)
        vn = tl.load(vn_ptr + v_blk + cv[None, :], mask=mv, other=0.0)
        dvl = mm(tl.trans(aqk), do, OPD) * scale
        tl.store(dvl_ptr + v_blk + cv[None, :], dvl, mask=mv)
        dqk = mm_acc(do, tl.trans(vn), dqk, OPD)
    # d(gc_i - gc_j) = dA_qk * A_qk; the decay is recomputed rather than kept live across the V walk
    m = dqk * aqk * scale
    tl.store(dgcp_ptr + tv + rows * HV, tl.sum(m, 1) - tl.sum(m, 0), mask=rm)
    ds = dqk * decay_diff(gc, gc, causal) * scale
    for i_k in range(0, tl.cdiv(K, BK)):
        ck = i_k * BK + tl.arange(0, BK)
        mk = rm[:, None] & (ck[None, :] < K)
        q = tl.load(q_ptr + qk_blk + ck[None, :], mask=mk, other=0.0)
        k = tl.load(k_ptr + qk_blk + ck[None, :], mask=mk, other=0.0)
        tl.store(dq_ptr + kv_blk + ck[None, :], mm(ds, k, OPD), mask=mk)
        tl.store(dk_ptr + kv_blk + ck[None, :], mm(tl.trans(ds), q, OPD), mask=mk)


@triton.jit
def _bwd_read(b_dh, dh_ptr, dh_base, k_ptr, k_base, i_k: tl.constexpr, rows, rm, cv, K, V, H, e_row, acc,
              BK: tl.constexpr, OPD: tl.constexpr):
    """Save one K-block of dS' (rounded to OPD) and add its ``(k * exp(g_last - gc)) @ dS'`` to acc."""
    dh_op = opnd(b_dh, OPD)
    state_block_store(dh_ptr, dh_base, i_k, cv, K, V, dh_op, BK)
    kd = rows_block(k_ptr, k_base, i_k, rows, rm, K, H * K, BK).to(tl.float32) * e_row[:, None]
    return mm_acc(kd, dh_op, acc, OPD)


@triton.jit
def _bwd_step(b_dh, q_ptr, q_base, w_ptr, w_base, i_k: tl.constexpr, rows, rm, K, H, HV, qe_row, e_last, do, dvn,
              BK: tl.constexpr, OPD: tl.constexpr):
    """One K-block of dS = exp(g_last) dS' + (q * scale exp(gc))^T @ dO - w^T @ dvn."""
    qg = rows_block(q_ptr, q_base, i_k, rows, rm, K, H * K, BK).to(tl.float32) * qe_row[:, None]
    b_dh = mm_acc(tl.trans(qg), do, b_dh * e_last, OPD)
    w = rows_block(w_ptr, w_base, i_k, rows, rm, K, HV * K, BK)
    return mm_acc(-tl.trans(w), dvn, b_dh, OPD)


@triton.jit
def state_bwd_kernel(q_ptr, k_ptr, w_ptr, gc_ptr, do_ptr, dvl_ptr, dvn_ptr, dh_ptr, dht_ptr, dh0_ptr,
                     cu_ptr, coff_ptr, scale,
                     H, HV, K, V,
                     BT: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr, BV: tl.constexpr,
                     HAS_DHT: tl.constexpr, OPD: tl.constexpr):
    """Per (sequence, V-block, value head); the carried gradient stays fp32, as NK <= 4 blocks of
    ``[BK, BV]`` (see state_fwd_kernel)."""
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
    b_dh1 = state_block_load(dht_ptr, st_base, 0, cv, K, V, BK, HAS_DHT, BV)
    if NK > 1:
        b_dh2 = state_block_load(dht_ptr, st_base, 1, cv, K, V, BK, HAS_DHT, BV)
    if NK > 2:
        b_dh3 = state_block_load(dht_ptr, st_base, 2, cv, K, V, BK, HAS_DHT, BV)
    if NK > 3:
        b_dh4 = state_block_load(dht_ptr, st_base, 3, cv, K, V, BK, HAS_DHT, BV)
    for it in range(0, nt):
        c = nt - 1 - it
        start = bos + c * BT
        nv = tl.minimum(eos - start, BT)
        rm = rows < nv
        mv = rm[:, None] & (cv[None, :] < V)
        tv = start * HV + i_hv
        dh_base = ((c0 + c) * HV + i_hv) * (K * V)
        k_base = start * (H * K) + i_h * K
        gc = tl.load(gc_ptr + tv + rows * HV, mask=rm, other=0.0)
        g_last = tl.load(gc_ptr + tv + (nv - 1) * HV)
        e_row = tl.exp((g_last - gc).to(tl.float32))
        acc = tl.load(dvl_ptr + tv * V + v_off, mask=mv, other=0.0)
        acc = _bwd_read(b_dh1, dh_ptr, dh_base, k_ptr, k_base, 0, rows, rm, cv, K, V, H, e_row, acc, BK, OPD)
        if NK > 1:
            acc = _bwd_read(b_dh2, dh_ptr, dh_base, k_ptr, k_base, 1, rows, rm, cv, K, V, H, e_row, acc, BK, OPD)
        if NK > 2:
            acc = _bwd_read(b_dh3, dh_ptr, dh_base, k_ptr, k_base, 2, rows, rm, cv, K, V, H, e_row, acc, BK, OPD)
        if NK > 3:
            acc = _bwd_read(b_dh4, dh_ptr, dh_base, k_ptr, k_base, 3, rows, rm, cv, K, V, H, e_row, acc, BK, OPD)
        dvn = opnd(acc, OPD)
        tl.store(dvn_ptr + tv * V + v_off, dvn.to(dvn_ptr.dtype.element_ty), mask=mv)
        do = tl.load(do_ptr + tv * V + v_off, mask=mv, other=0.0)
        qe_row = tl.exp(gc.to(tl.float32)) * scale
        e_last = tl.exp(g_last.to(tl.float32))
        b_dh1 = _bwd_step(b_dh1, q_ptr, k_base, w_ptr, tv * K, 0, rows, rm, K, H, HV, qe_row, e_last, do, dvn,
                          BK, OPD)
        if NK > 1:
            b_dh2 = _bwd_step(b_dh2, q_ptr, k_base, w_ptr, tv * K, 1, rows, rm, K, H, HV, qe_row, e_last, do, dvn,
                              BK, OPD)
        if NK > 2:
            b_dh3 = _bwd_step(b_dh3, q_ptr, k_base, w_ptr, tv * K, 2, rows, rm, K, H, HV, qe_row, e_last, do, dvn,
                              BK, OPD)
        if NK > 3:
            b_dh4 = _bwd_step(b_dh4, q_ptr, k_base, w_ptr, tv * K, 3, rows, rm, K, H, HV, qe_row, e_last, do, dvn,
                              BK, OPD)
    state_block_store(dh0_ptr, st_base, 0, cv, K, V, b_dh1, BK)
    if NK > 1:
        state_block_store(dh0_ptr, st_base, 1, cv, K, V, b_dh2, BK)
    if NK > 2:
        state_block_store(dh0_ptr, st_base, 2, cv, K, V, b_dh3, BK)
    if NK > 3:
        state_block_store(dh0_ptr, st_base, 3, cv, K, V, b_dh4, BK)


@triton.jit(do_not_specialize=["T"])
def dqk_bwd_kernel(q_ptr, k_ptr, gc_ptr, h_ptr, dh_ptr, do_ptr, vn_ptr, dvn_ptr,
                   dq_ptr, dk_ptr, dw_ptr, dgcp_ptr, cu_ptr, cidx_ptr, scale,
                   T, H, HV, K, V,
                   BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, OPD: tl.constexpr):
    """Per (K-block, chunk, value head): the state terms of dq and dk (added to the intra-chunk
    parts), dw, and this K-block's d(gc) partial (slot 1 + K-block). dq/dk/dw are per value head
    (summed over the group by the caller)."""
    i_k = tl.program_id(0)
    i_c = tl.program_id(1)
    i_hv = tl.program_id(2)
    i_h = i_hv // (HV // H)
    start, nv = chunk_span(cu_ptr, cidx_ptr, i_c, BT)
    rows = tl.arange(0, BT)
    rm = rows < nv
    tv = start * HV + i_hv
    ck = i_k * BK + tl.arange(0, BK)
    mk = rm[:, None] & (ck[None, :] < K)
    st_base = (i_c.to(tl.int64) * HV + i_hv) * (K * V)
    v_blk = tv * V + rows[:, None] * (HV * V)

    dq_s = tl.zeros([BT, BK], dtype=tl.float32)     # dO @ S^T
    dkd = tl.zeros([BT, BK], dtype=tl.float32)      # vn @ dS'^T
    dw = tl.zeros([BT, BK], dtype=tl.float32)       # dvn @ S^T
    dsl = tl.zeros([BK], dtype=tl.float32)          # sum(dS' * S), reduced over K below
    for i_v in range(0, tl.cdiv(V, BV)):
        cv = i_v * BV + tl.arange(0, BV)
        mv = rm[:, None] & (cv[None, :] < V)
        mkv = (ck[:, None] < K) & (cv[None, :] < V)
        s_off = st_base + ck[:, None] * V + cv[None, :]
        s = tl.load(h_ptr + s_off, mask=mkv, other=0.0)
        ds = tl.load(dh_ptr + s_off, mask=mkv, other=0.0)
        do = tl.load(do_ptr + v_blk + cv[None, :], mask=mv, other=0.0)
        vn = tl.load(vn_ptr + v_blk + cv[None, :], mask=mv, other=0.0)
        dvn = tl.load(dvn_ptr + v_blk + cv[None, :], mask=mv, other=0.0)
        dq_s = mm_acc(do, tl.trans(s), dq_s, OPD)
        dkd = mm_acc(vn, tl.trans(ds), dkd, OPD)
        dw = mm_acc(dvn, tl.trans(s), dw, OPD)
        dsl += tl.sum(ds.to(tl.float32) * s.to(tl.float32), 1)

    kv_off = tv * K + rows[:, None] * (HV * K) + ck[None, :]
    qk_off = start * (H * K) + i_h * K + rows[:, None] * (H * K) + ck[None, :]
    q = tl.load(q_ptr + qk_off, mask=mk, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + qk_off, mask=mk, other=0.0).to(tl.float32)
    gc = tl.load(gc_ptr + tv + rows * HV, mask=rm, other=0.0)
    g_last = tl.load(gc_ptr + tv + (nv - 1) * HV)
    # o's inter-chunk term scale * exp(gc) * (q @ S)
    dq = dq_s * (tl.exp(gc.to(tl.float32)) * scale)[:, None]
    dgc = tl.sum(dq * q, 1)
    tl.store(dq_ptr + kv_off, tl.load(dq_ptr + kv_off, mask=mk, other=0.0) + dq, mask=mk)
    # state update: S' = exp(g_last) S + (k * exp(g_last - gc))^T @ vn
    e_last = tl.exp((g_last - gc).to(tl.float32))
    tl.store(dk_ptr + kv_off, tl.load(dk_ptr + kv_off, mask=mk, other=0.0) + dkd * e_last[:, None], mask=mk)
    p = tl.sum(dkd * k, 1) * e_last
    dg_last = tl.sum(p, 0) + tl.sum(dsl, 0) * tl.exp(g_last.to(tl.float32))
    dgc = dgc - p + tl.where(rows == nv - 1, dg_last, 0.0)
    tl.store(dw_ptr + kv_off, -dw, mask=mk)
    tl.store(dgcp_ptr + tl.cast(1 + i_k, tl.int64) * T * HV + tv + rows * HV, dgc, mask=rm)


@triton.jit(do_not_specialize=["T", "NKP"])
def wy_bwd_kernel(k_ptr, v_ptr, beta_ptr, gc_ptr, ai_ptr, dw_ptr, dvn_ptr, dk_ptr, dgcp_ptr,
                  dv_ptr, dbeta_ptr, dg_ptr, cu_ptr, cidx_ptr,
                  T, NKP, H, HV, K, V,
                  BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, OPD: tl.constexpr):
    """Per (chunk, value head): completes dk (in place), writes dv, dbeta and dg; d(gc) starts as
    the sum of the 1 + NKP partials of the earlier kernels."""
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)
    start, nv = chunk_span(cu_ptr, cidx_ptr, i_c, BT)
    rows = tl.arange(0, BT)
    rm = rows < nv
    tv = start * HV + i_hv
    t_v = tv + rows * HV
    k_blk = start * (H * K) + i_h * K + rows[:, None] * (H * K)
    kv_blk = tv * K + rows[:, None] * (HV * K)
    v_blk = tv * V + rows[:, None] * (HV * V)
    # Ai^T, read transposed: ait[i, j] = Ai[j, i]
    ait = tl.load(ai_ptr + tv * BT + rows[None, :] * (HV * BT) + rows[:, None], mask=rm[None, :], other=0.0)
    beta = tl.load(beta_ptr + t_v, mask=rm, other=0.0).to(tl.float32)
    gc = tl.load(gc_ptr + t_v, mask=rm, other=0.0)

    # w = Ai @ kb, kb = k * beta * exp(gc)
    eg = tl.exp(gc.to(tl.float32))
    bg = beta * eg
    dbeta = tl.zeros([BT], dtype=tl.float32)
    dgc = tl.zeros([BT], dtype=tl.float32)
    dai = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        ck = i_k * BK + tl.arange(0, BK)
        mk = rm[:, None] & (ck[None, :] < K)
        k = tl.load(k_ptr + k_blk + ck[None, :], mask=mk, other=0.0).to(tl.float32)
        dw = tl.load(dw_ptr + kv_blk + ck[None, :], mask=mk, other=0.0)
        dai = mm_acc(dw, tl.trans(k * bg[:, None]), dai, OPD)
        dkb = mm(ait, dw, OPD)
        dk = tl.load(dk_ptr + kv_blk + ck[None, :], mask=mk, other=0.0) + dkb * bg[:, None]
        tl.store(dk_ptr + kv_blk + ck[None, :], dk, mask=mk)
        dkbk = tl.sum(dkb * k, 1)
        dbeta += dkbk * eg
        dgc += dkbk * bg
    # u = Ai @ vb, vb = v * beta; du = dvn
    for i_v in range(0, tl.cdiv(V, BV)):
        cv = i_v * BV + tl.arange(0, BV)
        mv = rm[:, None] & (cv[None, :] < V)
        du = tl.load(dvn_ptr + v_blk + cv[None, :], mask=mv, other=0.0)
        v = tl.load(v_ptr + v_blk + cv[None, :], mask=mv, other=0.0).to(tl.float32)
        dai = mm_acc(du, tl.trans(v * beta[:, None]), dai, OPD)
        dvb = mm(ait, du, OPD)
        tl.store(dv_ptr + v_blk + cv[None, :], (dvb * beta[:, None]).to(dv_ptr.dtype.element_ty), mask=mv)
        dbeta += tl.sum(dvb * v, 1)
    # Ai = (I + A)^-1  =>  dA = -Ai^T dAi Ai^T on the strictly lower triangle; Ai is lower
    # triangular, so only dAi's strictly lower part reaches it.
    lower = rows[:, None] > rows[None, :]
    dai = tl.where(lower, dai, 0.0)
    da = -mm(mm(ait, dai, OPD), ait, OPD)
    # A[i, j] = beta_i (k_i . k_j) exp(gc_i - gc_j)
    da = da * decay_diff(gc, gc, lower)
    dkk = opnd(da * beta[:, None], OPD)
    kk = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        ck = i_k * BK + tl.arange(0, BK)
        mk = rm[:, None] & (ck[None, :] < K)
        k = tl.load(k_ptr + k_blk + ck[None, :], mask=mk, other=0.0)
        kk = mm_acc(k, tl.trans(k), kk, OPD)
        dk = mm_acc(tl.trans(dkk), k, mm(dkk, k, OPD), OPD)
        dk += tl.load(dk_ptr + kv_blk + ck[None, :], mask=mk, other=0.0)
        tl.store(dk_ptr + kv_blk + ck[None, :], dk, mask=mk)
    n = da * kk
    dbeta += tl.sum(n, 1)
    m = n * beta[:, None]
    dgc += tl.sum(m, 1) - tl.sum(m, 0) + tl.load(dgcp_ptr + t_v, mask=rm, other=0.0)
    for i_p in range(0, NKP):
        dgc += tl.load(dgcp_ptr + tl.cast(1 + i_p, tl.int64) * T * HV + t_v, mask=rm, other=0.0)
    # gc = inclusive cumsum of g inside the chunk  =>  dg = reverse inclusive cumsum of dgc
    dgc = tl.where(rm, dgc, 0.0).to(tl.float64)
    dg = tl.sum(dgc, 0) - tl.cumsum(dgc, 0) + dgc
    tl.store(dbeta_ptr + t_v, dbeta.to(dbeta_ptr.dtype.element_ty), mask=rm)
    tl.store(dg_ptr + t_v, dg.to(dg_ptr.dtype.element_ty), mask=rm)
