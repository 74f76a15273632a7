"""The chunked algorithm and its autograd Function, shared by every fused backend.

An *engine* does the work over all token chunks; the Function only allocates, reduces and
scales. Two engines exist: the C++ one (:mod:`._cpu`, the chunk loop in ``csrc/loss``) and
:class:`ChunkLoop` here, a Python loop over chunks that takes its per-row kernels from a
*rows* object (:class:`TorchRows` below for the NPU / generic path, :mod:`._triton` on CUDA).

Both engines expose::

    fwd(h, w, b, y, params, chunk, lse, loss, logp, ent, grad_scale, dh, dw_acc, db_acc, gb=None)
    bwd(h, w, b, y, params, chunk, lse, ent, ga, gb, gc, dh, dw_acc, db_acc)

``h`` [N, H] and ``w`` [V, H] share a dtype, ``y`` int64 [N]; the per-row outputs are fp32 [N];
``dh`` has h's dtype, ``dw_acc`` / ``db_acc`` are fp32 accumulators. ``ga``, ``gb``, ``gc`` are
the upstream per-row gradients of loss, logp and entropy (fp32 [N] or None); the forward's ``gb``
(an engine whose ``grad_logp_in_forward`` is true) adds ``gb[i] * logp_i`` to what its gradients
are taken of.

Three gradient modes:

- *loss only* (no logps / entropy asked for, reduction ``mean`` or ``sum``): the gradients are
  computed during the forward (the logits are at hand), and backward only scales them by the
  incoming scalar. Three GEMMs in all, as eager (the C++ bf16 / fp16 path, vocabulary-outer,
  recomputes the logits blocks it can neither park in the weight gradient nor spill: between 3
  and 4, 3 at about N <= H; its fp32 path goes vocabulary-outer only when all of them park, see
  ``csrc/loss/linear_ce.cpp``). The first backward consumes these buffers; another backward
  through a retained graph (``retain_graph=True``) takes the last mode's path.
- *expected logp gradient* (``logp_grad`` given, logps asked for, entropy not): the forward computes
  the gradients of ``sum(logp_grad * logps)`` in the same way, and the backward uses them, scaled,
  when the incoming logps gradient is exactly one scalar times ``logp_grad`` and the loss and
  entropy get none (a token-sum or token-mean NLL over a mask: the gradient is the same number at
  every counted token). Any other incoming gradient is recomputed as below: the forward's work
  is then wasted, so callers pass ``logp_grad`` only for such losses.
- otherwise the forward keeps ``lse`` and the entropy per row, and backward recomputes each
  chunk's logits (four GEMMs), because the upstream gradients of per-token outputs are known
  only then.

Without a gradient to compute (``torch.no_grad()``, or no input that requires one) :func:`apply`
runs the forward alone: the chunked logits and their row statistics, no gradient buffer, no
autograd node.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from .. import _alloc


class Params(NamedTuple):
    ignore_index: int
    label_smoothing: float
    softcap: float        # 0.0: no softcap
    temperature: float
    # The vocabulary the smoothing term averages over: 0 = the weight's rows. A vocabulary shard
    # (vocab_parallel) passes the full size, and marks rows whose label lies in another shard with
    # the label V (one past its rows): such a row has no target term here.
    vocab_total: int = 0


def default_chunk(n: int, v: int, dtype: torch.dtype) -> int:
    """Tokens per chunk: an fp32 chunk of logits of about 128 MB (512 MB in reduced precision,
    where every chunk also costs one pass over the fp32 weight-gradient accumulator)."""
    budget = (1 << 25) if dtype == torch.float32 else (1 << 27)
    return max(1, min(max(n, 1), budget // max(v, 1)))


class LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, engine, h, w, b, y, params: Params, reduction: str, want_logps: bool, want_ent: bool,
                chunk: int, logp_grad: Optional[torch.Tensor] = None):
        need = ctx.needs_input_grad[1:4]
        if not (want_logps and not want_ent and getattr(engine, "grad_logp_in_forward", False)):
            logp_grad = None
        eager_grads = any(need) and ((not (want_logps or want_ent) and reduction != "none")
                                     or logp_grad is not None)
        out, logp, ent, lse, n_valid, grads = forward_pass(engine, h, w, b, y, params, reduction, chunk, eager_grads,
                                                           need_w=need[1], logp_grad=logp_grad)
        ctx.set_materialize_grads(False)
        ctx.engine, ctx.params, ctx.reduction, ctx.chunk = engine, params, reduction, chunk
        ctx.eager_grads = eager_grads
        ctx.logp_grad = logp_grad if eager_grads else None
        ctx.w_dtype, ctx.b_dtype = w.dtype, None if b is None else b.dtype
        # The loss-only gradients (for an incoming 1.0) are held as a plain attribute, not as saved
        # tensors: the first backward takes them, scales them in place, hands them to autograd and drops
        # its own reference, so nothing here aliases what it returned (AccumulateGrad then adopts them
        # as .grad without a copy: it copies a gradient only while someone else still holds it). A
        # second backward through a retained graph finds them gone and recomputes from what is saved.
        ctx.grads = grads
        if any(need):
            # h is kept for that recompute in the loss-only mode too: [N, H], what eager's own linear
            # keeps for its backward. Keeping the [V, H] gradients for it instead would cost a second
            # [V, H] buffer in every backward (the scaling out of place, at the step's memory peak) and
            # an AccumulateGrad copy.
            ctx.save_for_backward(h, w, b, y, lse, ent, n_valid)
        return out, logp, ent

    @staticmethod
    def backward(ctx, g_loss, g_logp, g_ent):
        need_h, need_w, need_b = ctx.needs_input_grad[1:4]
        none = (None,) * 11
        if ctx.eager_grads:
            if ctx.logp_grad is not None:
                scale = None if g_loss is not None or g_ent is not None else logp_scale(g_logp, ctx.logp_grad)
            elif g_loss is None:  # the loss unused (only the internal logps / entropy were): no gradient
                return none
            else:
                scale = g_loss.float()
            grads = ctx.grads if scale is not None else None
            ctx.grads = None   # the first backward consumes them either way
            if grads is not None:
                dh, dw_acc, db_acc = grads
                # The buffers hold the gradients for an incoming 1.0 (the mean's 1 / n already applied;
                # all ignored: zeros). Scaled in place: a fresh [V, H] tensor would cost as much memory
                # again and, on the CPU, a slow first touch. They are this graph's alone (see forward).
                if scale.device.type == "cpu" and scale.item() == 1.0:
                    scale = None  # the usual loss.backward(): nothing to do, nothing rounded again
                gh = _scale_(dh, scale) if need_h else None
                gw = _scale_(dw_acc, scale).to(ctx.w_dtype) if need_w else None
                gb = _scale_(db_acc, scale).to(ctx.b_dtype) if need_b and db_acc is not None else None
                return (None, gh, gw, gb) + (None,) * 7
            # a backward after the first (retain_graph=True), or an incoming gradient the forward did
            # not expect: recomputed below, as the last mode does
        h, w, b, y, lse, ent, n_valid = ctx.saved_tensors
        grads = backward_pass(ctx.engine, h, w, b, y, ctx.params, ctx.reduction, ctx.chunk, lse, ent, n_valid,
                              g_loss, g_logp, g_ent, need_w=need_w)
        if grads is None:
            return none
        dh, dw_acc, db_acc = grads
        gw = dw_acc.to(w.dtype) if need_w else None
        gbias = db_acc.to(b.dtype) if need_b and db_acc is not None else None
        return (None, dh if need_h else None, gw, gbias) + (None,) * 7


def logp_scale(g_logp: Optional[torch.Tensor], expected: torch.Tensor) -> Optional[torch.Tensor]:
    """The scalar ``s`` (fp32 0-d) with ``g_logp == s * expected`` exactly, elementwise, or None when
    there is none (``g_logp`` None counts as ``s = 0``). One host read: whether to use the forward's
    gradients is a choice between two code paths."""
    if g_logp is None:
        return torch.zeros([], dtype=torch.float32, device=expected.device)
    g = g_logp.reshape(-1).float()
    nz = expected != 0
    if not bool(nz.any()):
        return None
    j = int(nz.to(torch.uint8).argmax())
    s = g[j] / expected[j]
    return s if bool(torch.equal(g, s * expected)) else None


def forward_pass(engine, h, w, b, y, params: Params, reduction: str, chunk: int, grads: bool, need_w: bool = True,
                 logp_grad: Optional[torch.Tensor] = None):
    """The forward over all chunks: ``(out, logp, ent, lse, n_valid, (dh, dw_acc, db_acc) or None)``.

    ``out`` is the loss reduced as asked; logp, ent and the row's log-sum-exp ``lse`` (the backward's
    statistic) fp32 ``[N]``; ``n_valid`` the fp32 count of counted labels. With ``grads`` (loss only,
    reduced), the gradients for an incoming 1.0 are computed on the way (:func:`grad_buffers`; the
    weight's only when ``need_w``, on an engine that can skip it); with ``logp_grad`` (fp32 [N]) as
    well, those of ``sum(logp_grad * logp)`` instead."""
    N = h.shape[0]
    dev = h.device
    lse, loss, logp, ent = (_alloc.empty(N, dtype=torch.float32, device=dev) for _ in range(4))
    n_valid = (y != params.ignore_index).sum().to(torch.float32)
    bufs = (None, None, None)
    grad_scale = 1.0
    if grads:
        bufs = grad_buffers(h, w, b, engine, need_w, forward=True)
        # The mean's 1 / n folded in here, so that backward's usual incoming gradient (1.0) leaves
        # these buffers as they are (a reduced-precision weight gradient is rounded only once).
        if logp_grad is not None:
            grad_scale = 0.0
        elif reduction == "mean":
            grad_scale = 1.0 / max(int(n_valid.item()), 1)
    # gb only when given: engines (and wrappers of them) from before it take no such keyword
    extra = {"gb": logp_grad} if grads and logp_grad is not None else {}
    engine.fwd(h, w, b, y, params, chunk, lse, loss, logp, ent, grad_scale, *bufs, **extra)
    if reduction == "none":
        out = loss
    elif reduction == "sum":
        out = loss.sum()
    else:
        out = loss.sum() / n_valid  # 0 / 0 = NaN when every label is ignored, as in torch
    return out, logp, ent, lse, n_valid, (bufs if grads else None)


def backward_pass(engine, h, w, b, y, params: Params, reduction: str, chunk: int, lse, ent, n_valid,
                  g_loss, g_logp, g_ent, need_w: bool = True):
    """The gradients from the forward's ``lse`` and ``ent`` (each chunk's logits recomputed):
    ``(dh, dw_acc, db_acc)`` (see :func:`grad_buffers`), or None when no upstream gradient is given."""
    ga, gb, gc = row_grads(g_loss, g_logp, g_ent, reduction, n_valid, h.shape[0])
    if ga is None and gb is None and gc is None:
        return None
    dh, dw_acc, db_acc = grad_buffers(h, w, b, engine, need_w)
    engine.bwd(h, w, b, y, params, chunk, lse, ent, ga, gb, gc, dh, dw_acc, db_acc)
    return dh, dw_acc, db_acc


def _scale_(t, scale):
    """``t *= scale`` in place (``scale`` None: unchanged); reduced-precision ``t`` is scaled a
    block of rows at a time with the product in fp32, so no fp32 copy of a [V, H] gradient exists."""
    if scale is None:
        return t
    if t.dtype == torch.float32:
        return t.mul_(scale)
    rows = max(1, (1 << 22) // (math.prod(t.shape[1:]) or 1))
    for r0 in range(0, t.shape[0], rows):
        blk = t[r0:r0 + rows]
        blk.copy_(blk.float() * scale)
    return t


def row_grads(g_loss, g_logp, g_ent, reduction, n_valid, N):
    """The incoming gradients as fp32 [N] rows (or None): the loss's per token (a mean or sum
    spread over the rows, mean over the ``n_valid`` counted tokens), the logps' and the entropy's."""
    ga = None
    if g_loss is not None:
        if reduction == "none":
            ga = g_loss.reshape(N).float().contiguous()
        else:
            s = g_loss.float()
            if reduction == "mean":
                s = s / n_valid.clamp(min=1)
            ga = s.expand(N).contiguous()
    gb = None if g_logp is None else g_logp.reshape(N).float().contiguous()
    gc = None if g_ent is None else g_ent.reshape(N).float().contiguous()
    return ga, gb, gc


def grad_buffers(h, w, b, engine=None, need_w: bool = True, forward: bool = False):
    """dh (hidden's dtype), the weight-gradient buffer (fp32 zeros to accumulate into, or, for an
    engine whose ``weight_grad_dtype`` says so, the weight's dtype, written whole by the engine;
    for the ``forward`` of an engine whose ``fwd_writes_weight_grad`` is true, unzeroed in fp32 too)
    and the fp32 bias accumulator (or None). Without ``need_w`` (a frozen weight: LoRA's head, a
    tied embedding), an engine whose ``optional_dw`` is true gets None and skips the weight's
    GEMM, a third of the work; other engines fill a buffer that is dropped."""
    dh = _alloc.empty(h.shape, dtype=h.dtype, device=h.device)
    dw_dtype = getattr(engine, "weight_grad_dtype", lambda dt: torch.float32)(w.dtype)
    written = forward and getattr(engine, "fwd_writes_weight_grad", False)
    if not need_w and getattr(engine, "optional_dw", False):
        dw_acc = None
    elif dw_dtype == torch.float32 and not written:
        dw_acc = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
    else:
        dw_acc = _alloc.empty(w.shape, dtype=dw_dtype, device=w.device)
    db_acc = None if b is None else torch.zeros(w.shape[0], dtype=torch.float32, device=w.device)
    return dh, dw_acc, db_acc


def apply(engine, h, w, b, y, params: Params, reduction: str, want_logps: bool, want_ent: bool, chunk: int,
          logp_grad: Optional[torch.Tensor] = None):
    """(loss, logp, entropy): loss reduced as asked, logp / entropy fp32 [N]; ``logp_grad``: the
    expected-logp-gradient mode (see the module docstring), fp32 [N]."""
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (h, w, b))):
        # Forward only. Not through the Function: under torch.no_grad its ctx.needs_input_grad still
        # reads each input's requires_grad, and the loss-only mode would compute the gradients.
        out, logp, ent, _, _, _ = forward_pass(engine, h, w, b, y, params, reduction, chunk, False)
        return out, logp, ent
    return LinearCrossEntropyFunction.apply(engine, h, w, b, y, params, reduction, want_logps, want_ent, chunk,
                                            logp_grad)


# --- the Python chunk loop -------------------------------------------------------------------

class ChunkLoop:
    """Engine with the chunk loop in Python: GEMMs by ``torch.mm``, per-row work by ``rows``.

    ``rows.stats(x, y, params, lse, loss, logp, ent)`` reads the raw fp32 logits ``x`` [C, V];
    ``rows.grad(x, y, lse, ent, a, b, c, params)`` overwrites ``x`` with d(out)/dx, where
    ``a``, ``b``, ``c`` are fp32 [C] coefficients of loss, logp and entropy.
    """

    optional_dw = True   # dw_acc None: the weight's gradient is not computed
    grad_logp_in_forward = True   # fwd takes gb

    def __init__(self, rows):
        self.rows = rows

    @staticmethod
    def _logits(h, w, b, r0, r1):
        x = torch.mm(h[r0:r1], w.T).float()
        if b is not None:
            x += b.float()
        return x

    @staticmethod
    def _chunk_grads(dx, h, w, r0, r1, dh, dw_acc, db_acc):
        dxt = dx.to(w.dtype)
        torch.mm(dxt, w, out=dh[r0:r1])
        if dw_acc is None:   # a frozen weight: no dW GEMM
            pass
        elif w.dtype == torch.float32:
            dw_acc.addmm_(dxt.T, h[r0:r1])
        else:
            dw_acc += torch.mm(dxt.T, h[r0:r1])
        if db_acc is not None:
            db_acc += dx.sum(0)

    def fwd(self, h, w, b, y, params, chunk, lse, loss, logp, ent, grad_scale, dh, dw_acc, db_acc, gb=None):
        N = h.shape[0]
        for r0 in range(0, N, chunk):
            r1 = min(N, r0 + chunk)
            x = self._logits(h, w, b, r0, r1)
            yc = y[r0:r1]
            self.rows.stats(x, yc, params, lse[r0:r1], loss[r0:r1], logp[r0:r1], ent[r0:r1])
            if dh is not None:
                a = (yc != params.ignore_index).to(torch.float32) * grad_scale
                zeros = torch.zeros_like(a)
                rb = zeros if gb is None else gb[r0:r1]
                self.rows.grad(x, yc, lse[r0:r1], ent[r0:r1], a, rb, zeros, params)
                self._chunk_grads(x, h, w, r0, r1, dh, dw_acc, db_acc)

    def bwd(self, h, w, b, y, params, chunk, lse, ent, ga, gb, gc, dh, dw_acc, db_acc):
        N = h.shape[0]
        zeros = torch.zeros(N, dtype=torch.float32, device=h.device)
        ga, gb, gc = (zeros if g is None else g for g in (ga, gb, gc))
        for r0 in range(0, N, chunk):
            r1 = min(N, r0 + chunk)
            x = self._logits(h, w, b, r0, r1)
            self.rows.grad(x, y[r0:r1], lse[r0:r1], ent[r0:r1], ga[r0:r1], gb[r0:r1], gc[r0:r1], params)
            self._chunk_grads(x, h, w, r0, r1, dh, dw_acc, db_acc)


class TorchRows:
    """Per-row kernels in plain torch ops on one fp32 chunk (any device)."""

    @staticmethod
    def _z(x, p: Params):
        z = x / p.temperature
        if p.softcap > 0:
            z = p.softcap * torch.tanh(z / p.softcap)
        return z

    def stats(self, x, y, p: Params, lse, loss, logp, ent):
        z = self._z(x, p)
        V = z.shape[1]
        valid = y != p.ignore_index
        here = valid & (y < V)
        l = torch.logsumexp(z, dim=1)
        pz = (torch.softmax(z, dim=1) * z).sum(1)
        zero = torch.zeros_like(l)
        zy = torch.where(here, z.gather(1, torch.where(here, y, 0).unsqueeze(1)).squeeze(1), zero)
        eps = p.label_smoothing
        lse.copy_(torch.where(valid, l, zero))
        loss.copy_(torch.where(valid, l - (1 - eps) * zy - eps * z.sum(1) / (p.vocab_total or V), zero))
        logp.copy_(torch.where(valid, zy - l, zero))
        ent.copy_(torch.where(valid, l - pz, zero))

    def grad(self, x, y, lse, ent, a, b, c, p: Params):
        z = self._z(x, p)
        valid = y != p.ignore_index
        a, b, c = (torch.where(valid, t, torch.zeros_like(t)).unsqueeze(1) for t in (a, b, c))
        V = z.shape[1]
        here = (valid & (y < V)).unsqueeze(1)
        eps = p.label_smoothing
        pj = torch.exp(z - lse.unsqueeze(1))
        d = pj * (a - b - c * (ent.unsqueeze(1) - lse.unsqueeze(1)) - c * z) - a * eps / (p.vocab_total or V)
        d.scatter_add_(1, torch.where(here.squeeze(1), y, 0).unsqueeze(1),
                       torch.where(here, b - a * (1 - eps), torch.zeros_like(a)))
        if p.softcap > 0:
            d *= 1 - (z / p.softcap) ** 2
        # Ignored rows: lse is 0 there and exp(z) may overflow (inf * 0), so the row is zeroed outright.
        x.copy_(torch.where(valid.unsqueeze(1), d / p.temperature, torch.zeros_like(d)))


TORCH_ENGINE = ChunkLoop(TorchRows())
