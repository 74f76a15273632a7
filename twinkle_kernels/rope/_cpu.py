"""The rotary embedding on the C++ CPU backend (``csrc/rope``); its autograd is C++ (the ``rope``
op). The helpers here serve the backward of the custom op under torch.compile (``_library``).

q (and k) are viewed as ``[O, H, I, D]`` around the head dim ``unsqueeze_dim`` (no copy
for the usual ``[B, H, S, D]`` / ``[B, S, H, D]`` layouts, strided or not); cos / sin
become fp32 ``[O, I, R]`` tables, broadcast dims kept at stride 0 where a view allows.
No gradient flows to cos / sin here (the verifier sends such calls to the reference).
"""
from __future__ import annotations

import math

import torch

from .. import _alloc, _cpu_ext


def _frame(t: torch.Tensor, ud: int):
    """(O, H, I, D) of ``t`` around its head dim ``ud``."""
    s = t.shape
    return math.prod(s[:ud]), s[ud], math.prod(s[ud + 1:-1]), s[-1]


def _as4d(t: torch.Tensor, ud: int) -> torch.Tensor:
    t4 = t.reshape(_frame(t, ud))
    if t4.shape[3] > 1 and t4.stride(3) != 1:
        t4 = t4.contiguous()
    return t4


def _tables(cos: torch.Tensor, sin: torch.Tensor, t: torch.Tensor, ud: int):
    """cos / sin as fp32 ``[O, I, R]`` over ``t``'s frame, sharing strides."""
    o, _, i, _ = _frame(t, ud)
    r = cos.shape[-1]
    frame = t.shape[:ud] + t.shape[ud + 1:-1] + (r,)
    out = []
    for c in (cos, sin):
        c = c.detach()
        if c.dtype != torch.float32:
            c = c.to(torch.float32)
        c = c.expand(frame).reshape(o, i, r)
        if r > 1 and c.stride(2) != 1:
            c = c.contiguous()
        out.append(c)
    if out[0].stride() != out[1].stride():
        out = [c.contiguous() for c in out]
    return out


def _run_backward(q4, k4, tq, tk):
    """The backward kernel on q4 with tables tq and k4 with tables tk; one call when the tables agree."""
    op = _cpu_ext.ops().rope_bwd
    qo = _alloc.empty(q4.shape, dtype=q4.dtype, device=q4.device)
    ko = _alloc.empty(k4.shape, dtype=k4.dtype, device=k4.device)
    if tq is tk:
        op(q4, k4, tq[0], tq[1], qo, ko)
    else:
        op(q4, q4[:, :0], tq[0], tq[1], qo, qo[:, :0])
        op(k4, k4[:, :0], tk[0], tk[1], ko, ko[:, :0])
    return qo, ko


def apply_rotary_pos_emb_backward(dq, dk, cos, sin, ud):
    """The gradients of q and k (the op is linear in them: only cos / sin are needed); dq, dk in
    q's and k's shapes, cos / sin as the forward's."""
    tq = _tables(cos, sin, dq, ud)
    same = dq.shape[:ud] + dq.shape[ud + 1:] == dk.shape[:ud] + dk.shape[ud + 1:]
    tk = tq if same else _tables(cos, sin, dk, ud)
    gq, gk = _run_backward(_as4d(dq, ud), _as4d(dk, ud), tq, tk)
    return gq.view(dq.shape), gk.view(dk.shape)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim):
    # forward and backward in C++ (csrc/rope: torch::autograd::Function, the same frames and tables
    # as above): at small head counts a Python autograd.Function cost more than the kernels it ran
    qo, ko = _cpu_ext.op("rope")(q, k, cos, sin, unsqueeze_dim, _alloc.poisoning())
    return qo, ko
