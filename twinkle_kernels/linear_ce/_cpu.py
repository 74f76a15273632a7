"""C++ engine of the fused linear cross-entropy (``csrc/loss/linear_ce.cpp``): the whole chunk
loop runs in C++, with ATen's ``mm`` (torch's BLAS) for the chunk GEMMs."""
from __future__ import annotations

from .. import _cpu_ext
from ._chunked import Params


class CppEngine:
    def fwd(self, h, w, b, y, p: Params, chunk, lse, loss, logp, ent, grad_scale, dh, dw_acc, db_acc):
        _cpu_ext.ops().linear_ce_fwd(h, w, b, y, p.ignore_index, p.label_smoothing, p.softcap, p.temperature,
                                     chunk, lse, loss, logp, ent, grad_scale, dh, dw_acc, db_acc)

    def bwd(self, h, w, b, y, p: Params, chunk, lse, ent, ga, gb, gc, dh, dw_acc, db_acc):
        _cpu_ext.ops().linear_ce_bwd(h, w, b, y, p.ignore_index, p.label_smoothing, p.softcap, p.temperature,
                                     chunk, lse, ent, ga, gb, gc, dh, dw_acc, db_acc)


ENGINE = CppEngine()
