"""Triton backend of the gated delta rule: chunked forward + backward, fused recurrent forward.

Kernels live in :mod:`._triton_fwd` and :mod:`._triton_bwd`; this module packs the
arguments (a dense ``[B, T]`` call becomes B packed sequences of length T), launches the
kernels and wires the autograd Function. Arguments arrive validated from the public API
in :mod:`twinkle_kernels.gdn`.

Layout (fla): q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; g, beta ``[B, T, HV]``; states
``[N, HV, K, V]`` fp32. Value head j reads key head ``j // (HV // H)``. q/k/v/g/beta may be
fp32, bf16 or fp16 (outputs and grads take the input dtypes); K up to 256.

Precision: every ``tl.dot`` takes its operands in the precision :func:`operand_mode` picks
(bf16/fp16 inputs: their own dtype on the tensor cores; fp32: exact fp32 FMAs) and accumulates in fp32;
intermediates that are only dot operands are stored in that precision too. Kept wider: the
in-chunk cumulative decay ``gc`` (fp64: its differences enter ``exp``), the states carried
between chunks and everything elementwise (fp32), and the ``(I + A)^-1`` solve (fp32 FMAs).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton

from .. import _alloc
from . import _triton_bwd as bwd
from . import _triton_fwd as fwd
from ._triton_conv import causal_conv1d, causal_conv1d_backward

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "causal_conv1d", "causal_conv1d_backward",
           "unsupported_reason"]

L2NORM_EPS = 1e-6
MAX_CHUNK = 64
MAX_K = 256   # the state kernels hold K in at most four 64-row fp32 blocks per program


def unsupported_reason(q: torch.Tensor, v: torch.Tensor) -> Optional[str]:
    """Why the chunked Triton kernels cannot serve these shapes (None when they can)."""
    if q.shape[-1] > MAX_K:
        return f"the triton gated delta rule supports K <= {MAX_K} (got K={q.shape[-1]})"
    return None


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(int(n)))


def operand_mode(dtype: torch.dtype) -> str:
    """The ``OPD`` of the kernels for inputs of ``dtype`` (see :mod:`._triton_common`): bf16/fp16
    inputs multiply on the tensor cores in their own dtype; fp32 inputs keep exact fp32 products
    ("ieee", FMA). 3xTF32 ("tf32x3") would put fp32 on the tensor cores with fewer spills, but its
    ~2^-21 per-product error has not been measured against the fp32 tolerances on a GPU yet."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "ieee")


def _store_dtype(opd: str) -> torch.dtype:
    """dtype of the intermediates that are only dot operands (Ai, w, h, vn, dh, dvn)."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(opd, torch.float32)


def _state_block(K: int, V: int) -> int:
    """V-block of the sequential state kernels: their [K, BV] fp32 state stays at 4K values
    (32 registers a thread at 4 warps)."""
    return min(_pow2(V), max(16, 4096 // _pow2(K)))


# Launch configuration per kernel: (K-block, V-block, warps), the blocks capped by the head dims.
# Chosen with the compile lane so that no kernel spills registers at K = V = 128 on sm_80 or sm_90
# in bf16/fp16: sm_80's mma keeps both dot operands in registers, so the backward kernels, which
# hold two or three [64, 64] fp32 tiles besides, walk V (and wy_bwd K) in 32-wide blocks, on two
# warpgroups. The state kernels hold the whole K, in 64-row blocks.
_CONFIG = {
    "prep_fwd": (64, 0, 4),
    "wu_fwd": (64, 64, 4),
    "state_fwd": (0, 0, 4),
    "output_fwd": (64, 64, 8),
    "dvn_local": (64, 32, 8),
    "state_bwd": (0, 0, 8),
    "dqk_bwd": (64, 32, 8),
    "wy_bwd": (16, 32, 8),
}
# fp32 operands ("ieee": FMA dots) hold twice the bytes per tile: narrower blocks where that is
# what keeps a kernel in registers (the state kernels still spill with fp32 FMA dots; see operand_mode).
_CONFIG_FP32 = {
    "wu_fwd": (64, 64, 8),
    "dvn_local": (64, 16, 8),
    "wy_bwd": (16, 16, 8),
}


def _config(name: str, K: int, V: int, opd: str) -> dict:
    """BK, BV, num_warps (and num_stages) of kernel ``name`` for head dims K, V and operands ``opd``."""
    bk, bv, warps = (_CONFIG_FP32 if opd == "ieee" else {}).get(name, _CONFIG[name])
    if bk == 0:   # the sequential state kernels: K in NK <= 4 blocks held at once, V-block from _state_block
        bks = min(_pow2(K), 64)
        return dict(BK=bks, NK=triton.cdiv(K, bks), BV=_state_block(K, V), num_warps=warps, num_stages=1)
    cfg = dict(BK=min(_pow2(K), bk), num_warps=warps, num_stages=1)
    if bv:
        cfg["BV"] = min(_pow2(V), bv)
    return cfg


def _pack(cu_seqlens: Optional[torch.Tensor], B: int, T: int, device) -> torch.Tensor:
    if cu_seqlens is None:
        return torch.arange(B + 1, dtype=torch.int32, device=device) * T
    return cu_seqlens.to(device=device, dtype=torch.int32)


def _chunk_tables(cu: torch.Tensor, bt: int, device):
    """(chunk_idx [n_chunks, 2] int32: (sequence, chunk in sequence), chunk_off [N + 1] int32, n_chunks)
    on ``device``, from host offsets ``cu``."""
    lens = (cu[1:] - cu[:-1]).to(torch.int64)
    nts = (lens + bt - 1) // bt
    off = torch.zeros(len(nts) + 1, dtype=torch.int64)
    off[1:] = torch.cumsum(nts, 0)
    seq = torch.repeat_interleave(torch.arange(len(nts)), nts)
    pos = torch.arange(int(off[-1])) - off[:-1].repeat_interleave(nts)
    idx = torch.stack([seq, pos], 1).to(torch.int32).contiguous()
    return idx.to(device), off.to(torch.int32).to(device), int(off[-1])


# Dense calls repeat the same few (B, T) shapes: their tables are built once, so a training step
# pays neither the host work nor a device round trip for them.
_DENSE_TABLES: dict = {}


def _tables(cu_seqlens: Optional[torch.Tensor], B: int, T: int, bt: int, device):
    """(cu [N + 1] int32, chunk_idx, chunk_off, n_chunks) on ``device``."""
    if cu_seqlens is not None:
        return (cu_seqlens.to(device=device, dtype=torch.int32),) + _chunk_tables(cu_seqlens.cpu(), bt, device)
    key = (B, T, bt, str(device))
    hit = _DENSE_TABLES.get(key)
    if hit is None:
        cu = torch.arange(B + 1, dtype=torch.int64) * T
        hit = (cu.to(device=device, dtype=torch.int32),) + _chunk_tables(cu, bt, device)
        if len(_DENSE_TABLES) >= 64:
            _DENSE_TABLES.clear()
        _DENSE_TABLES[key] = hit
    return hit


def _l2norm_fwd(x: torch.Tensor):
    """x [..., D] -> (x / ||x|| in fp32, 1/||x|| [rows] fp32)."""
    D = x.shape[-1]
    rows = x.numel() // D if D else 0
    y = _alloc.empty(x.shape, dtype=torch.float32, device=x.device)
    r = _alloc.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        BR = 16
        fwd.l2norm_fwd_kernel[(triton.cdiv(rows, BR),)](x, y, r, rows, D, L2NORM_EPS, BR=BR, BD=_pow2(D))
    return y, r


def _l2norm_bwd(y, r, dy, dtype):
    D = y.shape[-1]
    rows = y.numel() // D if D else 0
    dx = _alloc.empty(y.shape, dtype=dtype, device=y.device)
    if rows:
        BR = 16
        fwd.l2norm_bwd_kernel[(triton.cdiv(rows, BR),)](y, r, dy, dx, rows, D, BR=BR, BD=_pow2(D))
    return dx


def _forward(q, k, v, g, beta, scale, h0, want_ht, tables, bt, opd):
    """Packed tensors ([T, ...]) -> (o, ht, saved intermediates)."""
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    cu, cidx, coff, NC = tables
    N = cu.numel() - 1
    dev = q.device
    sd, f32 = _store_dtype(opd), torch.float32
    gc = _alloc.empty(T, HV, dtype=torch.float64, device=dev)   # see prep_fwd_kernel
    ai = _alloc.empty(T, HV, bt, dtype=sd, device=dev)
    w = _alloc.empty(T, HV, K, dtype=sd, device=dev)
    u = _alloc.empty(T, HV, V, dtype=f32, device=dev)
    h = _alloc.empty(NC, HV, K, V, dtype=sd, device=dev)
    vn = _alloc.empty(T, HV, V, dtype=sd, device=dev)
    o = _alloc.empty(T, HV, V, dtype=v.dtype, device=dev)
    ht = _alloc.empty(N, HV, K, V, dtype=f32, device=dev) if want_ht else None
    meta = dict(H=H, HV=HV, K=K, BT=bt, OPD=opd)
    if NC:
        fwd.prep_fwd_kernel[(NC, HV)](k, g, beta, gc, ai, cu, cidx, **meta, **_config("prep_fwd", K, V, opd))
        fwd.wu_fwd_kernel[(NC, HV)](k, v, beta, gc, ai, w, u, cu, cidx, V=V, **meta, **_config("wu_fwd", K, V, opd))
    if N:
        cfg = _config("state_fwd", K, V, opd)
        fwd.state_fwd_kernel[(N, triton.cdiv(V, cfg["BV"]), HV)](
            k, w, u, gc, h, vn, h0 if h0 is not None else h, ht if ht is not None else h, cu, coff, V=V,
            HAS_H0=h0 is not None, STORE_HT=want_ht, **meta, **cfg)
    if NC:
        cfg = _config("output_fwd", K, V, opd)
        fwd.output_fwd_kernel[(NC, triton.cdiv(V, cfg["BV"]), HV)](q, k, vn, gc, h, o, cu, cidx, scale, V=V,
                                                                    **meta, **cfg)
    return o, ht, (gc, ai, w, h, vn, cidx, coff, NC)


def _backward(q, k, v, beta, scale, saved, do, dht, cu, bt, g_dtype, opd):
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    N = cu.numel() - 1
    dev = q.device
    gc, ai, w, h, vn, cidx, coff, NC = saved
    meta = dict(H=H, HV=HV, K=K, V=V, BT=bt, OPD=opd)
    dqk_cfg = _config("dqk_bwd", K, V, opd)
    NKB = triton.cdiv(K, dqk_cfg["BK"])   # dqk_bwd's K-blocks, each with its d(gc) partial
    sd, f32 = _store_dtype(opd), torch.float32
    dvl = _alloc.empty(T, HV, V, dtype=f32, device=dev)
    dvn = _alloc.empty(T, HV, V, dtype=sd, device=dev)
    dh = _alloc.empty(NC, HV, K, V, dtype=sd, device=dev)
    dh0 = _alloc.empty(N, HV, K, V, dtype=f32, device=dev)
    dq = _alloc.empty(T, HV, K, dtype=f32, device=dev)
    dk = _alloc.empty(T, HV, K, dtype=f32, device=dev)
    dw = _alloc.empty(T, HV, K, dtype=f32, device=dev)
    dgcp = _alloc.empty(1 + NKB, T, HV, dtype=f32, device=dev)   # d(gc) partials: intra-chunk, per K-block
    dv = _alloc.empty(T, HV, V, dtype=v.dtype, device=dev)
    dbeta = _alloc.empty(T, HV, dtype=beta.dtype, device=dev)
    dg = _alloc.empty(T, HV, dtype=g_dtype, device=dev)
    if NC:
        bwd.dvn_local_kernel[(NC, HV)](q, k, gc, do, vn, dvl, dq, dk, dgcp, cu, cidx, scale, T,
                                       **meta, **_config("dvn_local", K, V, opd))
    if N:
        cfg = _config("state_bwd", K, V, opd)
        bwd.state_bwd_kernel[(N, triton.cdiv(V, cfg["BV"]), HV)](
            q, k, w, gc, do, dvl, dvn, dh, dht if dht is not None else dh0, dh0, cu, coff, scale,
            HAS_DHT=dht is not None, **meta, **cfg)
    if NC:
        bwd.dqk_bwd_kernel[(NKB, NC, HV)](q, k, gc, h, dh, do, vn, dvn, dq, dk, dw, dgcp, cu, cidx, scale, T,
                                          **meta, **dqk_cfg)
        bwd.wy_bwd_kernel[(NC, HV)](k, v, beta, gc, ai, dw, dvn, dk, dgcp, dv, dbeta, dg, cu, cidx, T, NKB,
                                    **meta, **_config("wy_bwd", K, V, opd))
    if HV != H:   # value heads sharing a key head add their gradients
        dq = dq.view(T, H, HV // H, K).sum(2)
        dk = dk.view(T, H, HV // H, K).sum(2)
    return dq, dk, dv, dg, dbeta, dh0


class _ChunkGatedDeltaRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, scale, want_ht, l2norm, cu_seqlens, bt, opd):
        B, T, H, K = q.shape
        HV, V = v.shape[2], v.shape[3]
        tables = _tables(cu_seqlens, B, T, bt, q.device)
        cu = tables[0]
        qp = q.reshape(B * T, H, K).contiguous()
        kp = k.reshape(B * T, H, K).contiguous()
        vp = v.reshape(B * T, HV, V).contiguous()
        gp = g.reshape(B * T, HV).contiguous()
        bp = beta.reshape(B * T, HV).contiguous()
        h0c = h0.contiguous() if h0 is not None else None
        rq = rk = None
        if l2norm:
            qp, rq = _l2norm_fwd(qp)
            kp, rk = _l2norm_fwd(kp)
        o, ht, saved = _forward(qp, kp, vp, gp, bp, scale, h0c, want_ht, tables, bt, opd)
        ctx.save_for_backward(qp, kp, vp, bp, rq, rk, cu, *saved[:7])
        ctx.meta = (B, T, scale, l2norm, bt, opd, saved[7], q.dtype, k.dtype, g.dtype, h0 is not None,
                    h0.dtype if h0 is not None else None)
        return o.view(B, T, HV, V), ht

    @staticmethod
    def backward(ctx, do, dht):
        qp, kp, vp, bp, rq, rk, cu, gc, ai, w, h, vn, cidx, coff = ctx.saved_tensors
        B, T, scale, l2norm, bt, opd, NC, q_dtype, k_dtype, g_dtype, has_h0, h0_dtype = ctx.meta
        HV, V = vp.shape[1], vp.shape[2]
        H, K = qp.shape[1], qp.shape[2]
        do = do.reshape(B * T, HV, V).contiguous()
        dht = dht.contiguous() if dht is not None else None
        saved = (gc, ai, w, h, vn, cidx, coff, NC)
        dq, dk, dv, dg, dbeta, dh0 = _backward(qp, kp, vp, bp, scale, saved, do, dht, cu, bt, g_dtype, opd)
        if l2norm:
            dq = _l2norm_bwd(qp, rq, dq, q_dtype)
            dk = _l2norm_bwd(kp, rk, dk, k_dtype)
        else:
            dq, dk = dq.to(q_dtype), dk.to(k_dtype)
        return (dq.view(B, T, H, K), dk.view(B, T, H, K), dv.view(B, T, HV, V), dg.view(B, T, HV),
                dbeta.view(B, T, HV), dh0.to(h0_dtype) if has_h0 else None,
                None, None, None, None, None, None)


def chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                           cu_seqlens, chunk_size, *, operands: Optional[str] = None
                           ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Chunked gated delta rule on CUDA (or CPU under ``TRITON_INTERPRET=1``), forward + backward.

    q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; g, beta ``[B, T, HV]``; initial_state
    ``[N, HV, K, V]`` or None; cu_seqlens int ``[N + 1]`` (then B == 1) or None.
    Returns ``(o [B, T, HV, V] in v.dtype, final_state [N, HV, K, V] fp32 or None)``.
    ``operands`` overrides the dot operand precision (:func:`operand_mode` of v's dtype by
    default); ``"bf16emu"`` with fp32 inputs is how the tests check the bf16 path's numerics in
    the interpreter.
    """
    why = unsupported_reason(q, v)
    if why is not None:
        raise ValueError(why)
    # The result does not depend on the chunk size beyond rounding; 128-token chunks would
    # need [128, 128] fp32 tiles, twice the registers the kernels are sized for, so they run as 64.
    bt = min(int(chunk_size), MAX_CHUNK)
    if bt < 16 or bt & (bt - 1):
        raise ValueError(f"chunk_size must be a power of two >= 16 for the triton backend, got {chunk_size}")
    o, ht = _ChunkGatedDeltaRule.apply(q, k, v, g, beta, initial_state, float(scale), bool(output_final_state),
                                       bool(use_qk_l2norm_in_kernel), cu_seqlens, bt,
                                       operands or operand_mode(v.dtype))
    return o, (ht if output_final_state else None)


@torch.no_grad()
def fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                                     use_qk_l2norm_in_kernel, cu_seqlens, chunk_size=None):
    """Token-by-token gated delta rule (decode), forward only. Shapes as :func:`chunk_gated_delta_rule`."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    cu = _pack(cu_seqlens, B, T, q.device)
    N = cu.numel() - 1
    qp = q.reshape(B * T, H, K).contiguous()
    kp = k.reshape(B * T, H, K).contiguous()
    vp = v.reshape(B * T, HV, V).contiguous()
    gp = g.reshape(B * T, HV).contiguous()
    bp = beta.reshape(B * T, HV).contiguous()
    h0 = initial_state.contiguous() if initial_state is not None else None
    o = _alloc.empty(B * T, HV, V, dtype=v.dtype, device=v.device)
    ht = _alloc.empty(N, HV, K, V, dtype=torch.float32, device=v.device) if output_final_state else None
    BK, BV = _pow2(K), _state_block(K, V)   # the [BK, BV] fp32 state stays in registers
    if N:
        fwd.fused_recurrent_fwd_kernel[(N, triton.cdiv(V, BV), HV)](
            qp, kp, vp, gp, bp, o, h0 if h0 is not None else o, ht if ht is not None else o, cu, float(scale),
            H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, HAS_H0=h0 is not None, STORE_HT=bool(output_final_state),
            L2NORM=bool(use_qk_l2norm_in_kernel))
    return o.view(B, T, HV, V), ht
