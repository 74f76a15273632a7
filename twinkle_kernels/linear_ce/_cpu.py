"""C++ engine of the fused linear cross-entropy (``csrc/loss/linear_ce.cpp``): the whole loop runs
in C++, with ATen's ``mm`` (torch's BLAS) for the GEMMs.

fp32 inputs go token-outer (three GEMMs for the loss and its gradients, the weight gradient
accumulated in the fp32 output), except in the loss-only mode when every block of logits can be
parked (about N <= H, below): then vocabulary-outer as bf16, with the fp32 weight gradient written
one block at a time. bf16 / fp16 inputs go vocabulary-outer: the weight gradient is
made one vocabulary block at a time (fp32 inside the BLAS, or an fp32 block accumulator when
the tokens come in several chunks) and written in the weight's dtype, so no fp32 [V, H]
accumulator exists; the hidden gradient is accumulated over the blocks in fp32. A vocabulary block's
logits are needed twice (statistics, then gradients); in the loss-only mode with all tokens in one
chunk, the first pass keeps as many blocks as fit in the not-yet-written weight gradient (about
min(1, H / N) of them); the rest go to a spill of at most two blocks when it holds them all (about
N <= H), else they are recomputed.

The chunk is the kernels' own choice when not given (``chunk`` 0): every token up to 16384 in
bf16 / fp16; in fp32 all of them when the vocabulary-outer path is taken, else chunks of about 32M
logits (128 MB).
"""
from __future__ import annotations

import functools

import torch

from .. import _cpu_ext
from ._chunked import Params


def stale_reason():
    """Why the loaded extension cannot serve this engine, or None: a build from before the
    vocabulary-outer bf16 path has no ``vocab_block`` argument, one from before the fp32 written
    weight gradient no ``dw_written`` (rebuild with ``setup.py build_ext``)."""
    try:
        ops = _cpu_ext.ops()
    except Exception:  # no extension: the generic cpu check reports it
        return None
    return _stale(ops.__name__)


@functools.lru_cache(maxsize=None)
def _stale(namespace: str):
    args = [a.name for a in getattr(torch.ops, namespace.split(".")[-1]).linear_ce_fwd.default._schema.arguments]
    for name, what in (("vocab_block", "the vocabulary-outer path"),
                       ("dw_written", "the fp32 written weight gradient")):
        if name not in args:
            return f"the C++ extension is older than this linear_ce (no {name} argument: {what}); rebuild it"
    return None


class CppEngine:
    def __init__(self, vocab_block: int = 0):
        # vocabulary rows per block of the bf16 / fp16 path; 0: 8M entries per block of logits.
        self.vocab_block = vocab_block

    # Every build that passes stale_reason() (one with dw_written) also takes dw=None for a frozen
    # weight, skipping its GEMM, and per-row logp coefficients (gb) in the forward.
    optional_dw = True
    grad_logp_in_forward = True

    @staticmethod
    def weight_grad_dtype(w_dtype: torch.dtype) -> torch.dtype:
        """The dtype of the ``dw`` buffer the engine fills: the weight's own (fp32 accumulated into
        in the backward, written in the forward; bf16 / fp16 written once per vocabulary block)."""
        return w_dtype

    # The forward writes an fp32 dw whole (dw_written): its buffer comes unzeroed (the kernels zero
    # it first themselves), and its storage can hold the parked logits blocks of the loss-only mode.
    fwd_writes_weight_grad = True

    def fwd(self, h, w, b, y, p: Params, chunk, lse, loss, logp, ent, grad_scale, dh, dw, db_acc, gb=None):
        _cpu_ext.ops().linear_ce_fwd(h, w, b, y, p.ignore_index, p.label_smoothing, p.softcap, p.temperature,
                                     chunk, self.vocab_block, lse, loss, logp, ent, grad_scale, dh, dw, db_acc,
                                     gb, dw_written=True)

    def bwd(self, h, w, b, y, p: Params, chunk, lse, ent, ga, gb, gc, dh, dw, db_acc):
        _cpu_ext.ops().linear_ce_bwd(h, w, b, y, p.ignore_index, p.label_smoothing, p.softcap, p.temperature,
                                     chunk, self.vocab_block, lse, ent, ga, gb, gc, dh, dw, db_acc)


ENGINE = CppEngine()
