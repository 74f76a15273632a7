"""Triton backward kernels of the chunked gated delta rule.

Notation as in :mod:`._triton_fwd`. The forward saves, per chunk, the chunk-start states
``h`` (``S``), ``gc``, ``Ai``, ``w`` and ``vn``; the backward runs:

1. ``dvn_local_kernel``: the intra-chunk part of dvn, ``scale * causal(q k^T * decay)^T @ dO``.
2. ``state_bwd_kernel``: walks each sequence's chunks backwards carrying ``dS'`` (the gradient
   of the chunk-end state), saving it per chunk as ``dh``, completing
   ``dvn = dvn_local + (k * exp(gc_last - gc)) @ dS'`` and stepping
   ``dS = exp(gc_last) dS' + scale (q exp(gc))^T dO - w^T dvn``. What is left at the start is
   the gradient of the initial state.
3. ``dqk_bwd_kernel``: per chunk, dq (final), dw, and the parts of dk and d(gc) that come
   from the output and the state update.
4. ``wy_bwd_kernel``: back through ``w = Ai kb``, ``u = Ai vb`` and ``Ai = (I + A)^-1``
   (``dA = -Ai^T dAi Ai^T``), giving dv, dbeta, the rest of dk and d(gc), then dg as the
   reverse cumulative sum of d(gc) inside the chunk.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._triton_fwd import chunk_span


@triton.jit(do_not_specialize=["H", "HV", "K", "V"])
def dvn_local_kernel(q_ptr, k_ptr, gc_ptr, do_ptr, dvl_ptr, cu_ptr, cidx_ptr, scale,
                     H, HV, K, V,
                     BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DOT: tl.constexpr):
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
    gc = tl.load(gc_ptr + tok * HV + i_hv, mask=rm, other=0.0)
    do = tl.load(do_ptr + tok[:, None] * (HV * V) + i_hv * V + cv[None, :], mask=mv, other=0.0).to(tl.float32)
    causal = rows[:, None] >= rows[None, :]
    qk = tl.dot(q, tl.trans(k), input_precision=DOT)
    qk = tl.where(causal, qk * tl.exp(tl.where(causal, gc[:, None] - gc[None, :], 0.0)), 0.0)
    dvl = tl.dot(tl.trans(qk), do, input_precision=DOT) * scale
    tl.store(dvl_ptr + tok[:, None] * (HV * V) + i_hv * V + cv[None, :], dvl, mask=mv)


@triton.jit(do_not_specialize=["H", "HV", "K", "V"])
def state_bwd_kernel(q_ptr, k_ptr, w_ptr, gc_ptr, do_ptr, dvl_ptr, dvn_ptr, dh_ptr, dht_ptr, dh0_ptr,
                     cu_ptr, coff_ptr, scale,
                     H, HV, K, V,
                     BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     HAS_DHT: tl.constexpr, DOT: tl.constexpr):
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
    if HAS_DHT:
        b_dh = tl.load(dht_ptr + st_base + s_off, mask=mkv, other=0.0).to(tl.float32)
    else:
        b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    for it in range(0, nt):
        c = nt - 1 - it
        start = bos + c * BT
        nv = tl.minimum(eos - start, BT)
        rm = rows < nv
        tok = start + rows
        tl.store(dh_ptr + ((c0 + c) * HV + i_hv) * (K * V) + s_off, b_dh, mask=mkv)
        mk = rm[:, None] & (ck[None, :] < K)
        mv = rm[:, None] & (cv[None, :] < V)
        gc = tl.load(gc_ptr + tok * HV + i_hv, mask=rm, other=0.0)
        g_last = tl.load(gc_ptr + (start + nv - 1) * HV + i_hv)
        k = tl.load(k_ptr + tok[:, None] * (H * K) + i_h * K + ck[None, :], mask=mk, other=0.0).to(tl.float32)
        kd = k * tl.exp(g_last - gc)[:, None]
        v_off = tok[:, None] * (HV * V) + i_hv * V + cv[None, :]
        dvn = tl.load(dvl_ptr + v_off, mask=mv, other=0.0) + tl.dot(kd, b_dh, input_precision=DOT)
        tl.store(dvn_ptr + v_off, dvn, mask=mv)
        q = tl.load(q_ptr + tok[:, None] * (H * K) + i_h * K + ck[None, :], mask=mk, other=0.0).to(tl.float32)
        qg = q * (tl.exp(gc) * scale)[:, None]
        w = tl.load(w_ptr + tok[:, None] * (HV * K) + i_hv * K + ck[None, :], mask=mk, other=0.0)
        do = tl.load(do_ptr + v_off, mask=mv, other=0.0).to(tl.float32)
        b_dh = (b_dh * tl.exp(g_last) + tl.dot(tl.trans(qg), do, input_precision=DOT)
                - tl.dot(tl.trans(w), dvn, input_precision=DOT))
    tl.store(dh0_ptr + st_base + s_off, b_dh, mask=mkv)


@triton.jit(do_not_specialize=["H", "HV", "K", "V"])
def dqk_bwd_kernel(q_ptr, k_ptr, gc_ptr, h_ptr, dh_ptr, do_ptr, vn_ptr, dvn_ptr,
                   dq_ptr, dk_ptr, dw_ptr, dgc_ptr, cu_ptr, cidx_ptr, scale,
                   H, HV, K, V,
                   BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DOT: tl.constexpr):
    """Per (chunk, value head); dq/dk/dw are per value head (summed over the group by the caller)."""
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)
    start, nv = chunk_span(cu_ptr, cidx_ptr, i_c, BT)
    rows = tl.arange(0, BT)
    rm = rows < nv
    tok = start + rows
    ck = tl.arange(0, BK)
    mk = rm[:, None] & (ck[None, :] < K)
    st_base = (i_c.to(tl.int64) * HV + i_hv) * (K * V)

    dq_s = tl.zeros([BT, BK], dtype=tl.float32)     # dO @ S^T
    dkd = tl.zeros([BT, BK], dtype=tl.float32)      # vn @ dS'^T
    dw = tl.zeros([BT, BK], dtype=tl.float32)       # -dvn @ S^T
    dqk = tl.zeros([BT, BT], dtype=tl.float32)      # dO @ vn^T
    dsl = tl.zeros([BK], dtype=tl.float32)          # sum(dS' * S), reduced over K below
    for i_v in range(0, tl.cdiv(V, BV)):
        cv = i_v * BV + tl.arange(0, BV)
        mv = rm[:, None] & (cv[None, :] < V)
        mkv = (ck[:, None] < K) & (cv[None, :] < V)
        s_off = st_base + ck[:, None] * V + cv[None, :]
        s = tl.load(h_ptr + s_off, mask=mkv, other=0.0)
        ds = tl.load(dh_ptr + s_off, mask=mkv, other=0.0)
        v_off = tok[:, None] * (HV * V) + i_hv * V + cv[None, :]
        do = tl.load(do_ptr + v_off, mask=mv, other=0.0).to(tl.float32)
        vn = tl.load(vn_ptr + v_off, mask=mv, other=0.0)
        dvn = tl.load(dvn_ptr + v_off, mask=mv, other=0.0)
        dq_s += tl.dot(do, tl.trans(s), input_precision=DOT)
        dkd += tl.dot(vn, tl.trans(ds), input_precision=DOT)
        dw -= tl.dot(dvn, tl.trans(s), input_precision=DOT)
        dqk += tl.dot(do, tl.trans(vn), input_precision=DOT)
        dsl += tl.sum(ds * s, 1)

    q = tl.load(q_ptr + tok[:, None] * (H * K) + i_h * K + ck[None, :], mask=mk, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + tok[:, None] * (H * K) + i_h * K + ck[None, :], mask=mk, other=0.0).to(tl.float32)
    gc = tl.load(gc_ptr + tok * HV + i_hv, mask=rm, other=0.0)
    g_last = tl.load(gc_ptr + (start + nv - 1) * HV + i_hv)

    # o's inter-chunk term scale * exp(gc) * (q @ S)
    dq = dq_s * (tl.exp(gc) * scale)[:, None]
    dgc = tl.sum(dq * q, 1)
    # o's intra-chunk term: A_qk[i, j] = (q_i . k_j) exp(gc_i - gc_j), j <= i
    causal = rows[:, None] >= rows[None, :]
    dqk = tl.where(causal, dqk * scale * tl.exp(tl.where(causal, gc[:, None] - gc[None, :], 0.0)), 0.0)
    dq += tl.dot(dqk, k, input_precision=DOT)
    dk = tl.dot(tl.trans(dqk), q, input_precision=DOT)
    m = dqk * tl.dot(q, tl.trans(k), input_precision=DOT)
    dgc += tl.sum(m, 1) - tl.sum(m, 0)
    # state update: S' = exp(g_last) S + (k * exp(g_last - gc))^T @ vn
    e_last = tl.exp(g_last - gc)
    dk += dkd * e_last[:, None]
    p = tl.sum(dkd * k, 1) * e_last
    dg_last = tl.sum(p, 0) + tl.sum(dsl, 0) * tl.exp(g_last)
    dgc = dgc - p + tl.where(rows == nv - 1, dg_last, 0.0)

    kv_off = tok[:, None] * (HV * K) + i_hv * K + ck[None, :]
    tl.store(dq_ptr + kv_off, dq, mask=mk)
    tl.store(dk_ptr + kv_off, dk, mask=mk)
    tl.store(dw_ptr + kv_off, dw, mask=mk)
    tl.store(dgc_ptr + tok * HV + i_hv, dgc, mask=rm)


@triton.jit(do_not_specialize=["H", "HV", "K", "V"])
def wy_bwd_kernel(k_ptr, v_ptr, beta_ptr, gc_ptr, ai_ptr, dw_ptr, dvn_ptr, dk_ptr, dgc_ptr,
                  dv_ptr, dbeta_ptr, dg_ptr, cu_ptr, cidx_ptr,
                  H, HV, K, V,
                  BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DOT: tl.constexpr):
    """Per (chunk, value head): completes dk (in place), writes dv, dbeta and dg."""
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)
    start, nv = chunk_span(cu_ptr, cidx_ptr, i_c, BT)
    rows = tl.arange(0, BT)
    rm = rows < nv
    tok = start + rows
    ck = tl.arange(0, BK)
    mk = rm[:, None] & (ck[None, :] < K)
    kv_off = tok[:, None] * (HV * K) + i_hv * K + ck[None, :]
    ai = tl.load(ai_ptr + tok[:, None] * (HV * BT) + i_hv * BT + rows[None, :], mask=rm[:, None], other=0.0)
    k = tl.load(k_ptr + tok[:, None] * (H * K) + i_h * K + ck[None, :], mask=mk, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + tok * HV + i_hv, mask=rm, other=0.0).to(tl.float32)
    gc = tl.load(gc_ptr + tok * HV + i_hv, mask=rm, other=0.0)
    dw = tl.load(dw_ptr + kv_off, mask=mk, other=0.0)
    dk = tl.load(dk_ptr + kv_off, mask=mk, other=0.0)
    dgc = tl.load(dgc_ptr + tok * HV + i_hv, mask=rm, other=0.0)

    # w = Ai @ kb, kb = k * beta * exp(gc)
    bg = beta * tl.exp(gc)
    kb = k * bg[:, None]
    dai = tl.dot(dw, tl.trans(kb), input_precision=DOT)
    dkb = tl.dot(tl.trans(ai), dw, input_precision=DOT)
    dk += dkb * bg[:, None]
    dkbk = tl.sum(dkb * k, 1)
    dbeta = dkbk * tl.exp(gc)
    dgc += dkbk * bg
    # u = Ai @ vb, vb = v * beta; du = dvn
    for i_v in range(0, tl.cdiv(V, BV)):
        cv = i_v * BV + tl.arange(0, BV)
        mv = rm[:, None] & (cv[None, :] < V)
        v_off = tok[:, None] * (HV * V) + i_hv * V + cv[None, :]
        du = tl.load(dvn_ptr + v_off, mask=mv, other=0.0)
        v = tl.load(v_ptr + v_off, mask=mv, other=0.0).to(tl.float32)
        dai += tl.dot(du, tl.trans(v * beta[:, None]), input_precision=DOT)
        dvb = tl.dot(tl.trans(ai), du, input_precision=DOT)
        tl.store(dv_ptr + v_off, (dvb * beta[:, None]).to(dv_ptr.dtype.element_ty), mask=mv)
        dbeta += tl.sum(dvb * v, 1)
    # Ai = (I + A)^-1  =>  dA = -Ai^T dAi Ai^T, kept on the strictly lower triangle
    lower = rows[:, None] > rows[None, :]
    ait = tl.trans(ai)
    da = -tl.dot(tl.dot(ait, dai, input_precision=DOT), ait, input_precision=DOT)
    # A[i, j] = beta_i (k_i . k_j) exp(gc_i - gc_j)
    da = tl.where(lower, da * tl.exp(tl.where(lower, gc[:, None] - gc[None, :], 0.0)), 0.0)
    kk = tl.dot(k, tl.trans(k), input_precision=DOT)
    dbeta += tl.sum(da * kk, 1)
    dkk = da * beta[:, None]
    dk += tl.dot(dkk, k, input_precision=DOT) + tl.dot(tl.trans(dkk), k, input_precision=DOT)
    m = dkk * kk
    dgc += tl.sum(m, 1) - tl.sum(m, 0)
    # gc = inclusive cumsum of g inside the chunk  =>  dg = reverse inclusive cumsum of dgc
    dgc = tl.where(rm, dgc, 0.0)
    dg = tl.sum(dgc, 0) - tl.cumsum(dgc, 0) + dgc

    tl.store(dk_ptr + kv_off, dk, mask=mk)
    tl.store(dbeta_ptr + tok * HV + i_hv, dbeta.to(dbeta_ptr.dtype.element_ty), mask=rm)
    tl.store(dg_ptr + tok * HV + i_hv, dg.to(dg_ptr.dtype.element_ty), mask=rm)
