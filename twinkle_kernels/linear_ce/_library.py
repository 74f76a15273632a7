"""The fused linear cross-entropy as a ``torch.library`` custom op
(the rules: :mod:`twinkle_kernels._custom_ops`).

``twinkle::fused_linear_cross_entropy(hidden [N, H], weight [V, H], bias [V]?, labels int64 [N], ...,
grads) -> (loss, logps [N], entropy [N], lse [N], dhidden, dweight, dbias)``: loss ``[]`` (``reduction="none"``:
``[N]``); loss, logps, entropy and lse (each row's log-sum-exp, the backward's statistic) fp32 (fp64 for
fp64 inputs). Every backend computes logps and entropy anyway, so they are always returned and the public
function keeps only the asked ones (no optional outputs, no dynamic sizes).

Gradients, as the eager autograd Function computes them:

- *loss only* (no logps / entropy asked for, a reduced loss) with ``grads=True`` (the public function
  passes it when a gradient is wanted): the forward op computes the gradients for an incoming 1.0
  while the logits are at hand and returns them (``dhidden`` in hidden's dtype, ``dweight`` in weight's,
  ``dbias`` in bias's; three GEMMs in all, as eager); the backward scales them by the incoming
  gradient (plain torch ops, traced into the backward graph). Without ``grads`` these three are empty
  ``[0]`` stand-ins.
- otherwise ``fused_linear_cross_entropy_backward`` takes the forward's lse and entropy and runs the
  selected backend's backward over the chunks (each chunk's logits recomputed: four GEMMs, as eager).

The ``reference`` backend has no chunked backward: its gradients are autograd's of the unfused reference,
taken inside the forward op (loss only) or by rerunning it in the backward op (:func:`twinkle_kernels._custom_ops.vjp`).

The label range check reads the labels: under ``torch.compile`` it runs inside the op, with the same
ValueError as an eager call.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._custom_ops import NS, new_like, select, vjp
from . import _chunked
from ._chunked import Params
from .reference import transformed_logits


def check_labels(y: torch.Tensor, num_classes: int, ignore_index: int) -> None:
    """y: int64 ``[N]``; each label in ``[0, num_classes)`` or ``ignore_index``."""
    bad = ((y < 0) | (y >= num_classes)) & (y != ignore_index)
    if y.numel() and bool(bad.any()):
        first = int(y[bad][0])
        raise ValueError(f"labels must be in [0, {num_classes}) (weight's rows) or ignore_index={ignore_index}; "
                         f"got {first}")


def _params(ignore_index, label_smoothing, softcap, temperature):
    return Params(ignore_index, label_smoothing, softcap, temperature)


def _stat_dtype(h: torch.Tensor) -> torch.dtype:
    return torch.float64 if h.dtype == torch.float64 else torch.float32


def _none(t: torch.Tensor, dtype=None) -> torch.Tensor:
    """The stand-in for an absent gradient output."""
    return t.new_empty((0,), dtype=dtype or t.dtype)


def chunked_stages(engine_of):
    """The forward and backward of a chunked backend (``linear_ce._chunked``), registered as its
    ``Stages``; ``engine_of(h, w, chunk) -> (engine, chunk)`` (chunk 0: the backend's default)."""

    def forward(h, w, b, y, params, reduction, want_logps, want_ent, chunk, grads):
        engine, chunk = engine_of(h, w, chunk)
        out, logp, ent, lse, _, bufs = _chunked.forward_pass(engine, h, w, b, y, params, reduction, chunk, grads)
        if bufs is None:
            return out, logp, ent, lse, None, None, None
        dh, dw, db = bufs
        return out, logp, ent, lse, dh, dw.to(w.dtype), (None if db is None else db.to(b.dtype))

    def backward(g_loss, g_logp, g_ent, h, w, b, y, lse, ent, params, reduction, chunk):
        engine, chunk = engine_of(h, w, chunk)
        n_valid = (y != params.ignore_index).sum().to(torch.float32)
        got = _chunked.backward_pass(engine, h, w, b, y, params, reduction, chunk, lse, ent, n_valid,
                                     g_loss, g_logp, g_ent)
        if got is None:
            return torch.zeros_like(h), torch.zeros_like(w), (None if b is None else torch.zeros_like(b))
        dh, dw, db = got
        return dh, dw.to(w.dtype), (None if db is None else db.to(b.dtype))
    return forward, backward


def _reference_lse(h, w, b, y, params):
    """Each row's log-sum-exp of the transformed logits, 0 on ignored rows, as the chunked engines
    store it."""
    lse = torch.logsumexp(transformed_logits(h, w, b, params.softcap or None, params.temperature), -1)
    return torch.where(y != params.ignore_index, lse, torch.zeros_like(lse))


@torch.library.custom_op(f"{NS}::fused_linear_cross_entropy", mutates_args=())
def fused_linear_cross_entropy_op(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                                  labels: torch.Tensor, ignore_index: int, label_smoothing: float, softcap: float,
                                  temperature: float, reduction: str, return_logps: bool, return_entropy: bool,
                                  chunk_size: int, backend: Optional[str], grads: bool = False
                                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                             torch.Tensor, torch.Tensor]:
    check_labels(labels, weight.shape[0], ignore_index)
    params = _params(ignore_index, label_smoothing, softcap, temperature)
    args = (hidden, weight, bias, labels, params, reduction, return_logps, return_entropy, chunk_size)
    op, chosen, stages = select("fused_linear_cross_entropy", hidden.device, backend, *args)
    grads = grads and _loss_only(reduction, return_logps, return_entropy)
    if stages is not None:
        loss, logp, ent, lse, dh, dw, db = stages.forward(*args, grads)
    else:
        fn = op.impls[chosen].fn
        loss, logp, ent = fn(*args)
        lse = _reference_lse(hidden, weight, bias, labels, params)
        dh = dw = db = None
        if grads:
            inputs = (hidden, weight) if bias is None else (hidden, weight, bias)
            got = vjp(lambda h, w, *b: fn(h, w, b[0] if b else None, *args[3:])[0], inputs,
                      (torch.ones_like(loss),), tuple(range(len(inputs))))
            dh, dw, db = got if bias is not None else (*got, None)
    return (loss.contiguous(), logp.contiguous(), ent.contiguous(), lse.contiguous(),
            _none(hidden) if dh is None else dh.contiguous(), _none(weight) if dw is None else dw.contiguous(),
            _none(hidden) if db is None else db.contiguous())


def _loss_only(reduction: str, return_logps: bool, return_entropy: bool) -> bool:
    return reduction != "none" and not (return_logps or return_entropy)


@fused_linear_cross_entropy_op.register_fake
def _(hidden, weight, bias, labels, ignore_index, label_smoothing, softcap, temperature, reduction, return_logps,
      return_entropy, chunk_size, backend, grads=False):
    dt = _stat_dtype(hidden)
    n = hidden.shape[0]
    loss = hidden.new_empty((n,) if reduction == "none" else (), dtype=dt)
    stats = (hidden.new_empty((n,), dtype=dt) for _ in range(3))
    if grads and _loss_only(reduction, return_logps, return_entropy):
        g = (new_like(hidden), new_like(weight), _none(hidden) if bias is None else new_like(bias))
    else:
        g = (_none(hidden), _none(weight), _none(hidden))
    return (loss, *stats, *g)


@torch.library.custom_op(f"{NS}::fused_linear_cross_entropy_backward", mutates_args=())
def fused_linear_cross_entropy_backward(
        dloss: torch.Tensor, dlogp: torch.Tensor, dent: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
        bias: Optional[torch.Tensor], labels: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor, ignore_index: int,
        label_smoothing: float, softcap: float, temperature: float, reduction: str, return_logps: bool,
        return_entropy: bool, chunk_size: int, backend: Optional[str]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    params = _params(ignore_index, label_smoothing, softcap, temperature)
    args = (hidden, weight, bias, labels, params, reduction, return_logps, return_entropy, chunk_size)
    op, chosen, stages = select("fused_linear_cross_entropy", hidden.device, backend, *args)
    # the gradients of outputs the caller did not ask for are ignored (the backend's cheaper mode)
    g = (dloss, dlogp if return_logps else None, dent if return_entropy else None)
    if stages is not None:
        got = stages.backward(*g, hidden, weight, bias, labels, lse, ent, params, reduction, chunk_size)
    else:
        fn = op.impls[chosen].fn
        inputs = (hidden, weight) if bias is None else (hidden, weight, bias)
        got = vjp(lambda h, w, *b: fn(h, w, b[0] if b else None, *args[3:]), inputs, g, tuple(range(len(inputs))))
        got = got if bias is not None else (*got, None)
    dh, dw, db = got
    return dh.contiguous(), dw.contiguous(), (_none(hidden) if db is None else db.contiguous())


@fused_linear_cross_entropy_backward.register_fake
def _(dloss, dlogp, dent, hidden, weight, bias, *rest):
    return new_like(hidden), new_like(weight), (new_like(bias) if bias is not None else _none(hidden))


def _setup(ctx, inputs, output):
    hidden, weight, bias, labels, *args = inputs
    ctx.args, ctx.grads = args[:-1], args[-1] and _loss_only(args[4], args[5], args[6])
    ctx.has_bias = bias is not None
    lse, dh, dw, db = output[3:]
    ctx.mark_non_differentiable(lse, dh, dw, db)
    if ctx.grads:  # the forward computed the gradients: the backward only scales them
        ctx.save_for_backward(dh, dw, db)
    else:
        ctx.save_for_backward(hidden, weight, bias, labels, lse, output[2])


def _scaled(g: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``g * scale``, the product in fp32 at least (a reduced-precision gradient is rounded once)."""
    if g.dtype in (torch.float32, torch.float64):
        return g * scale.to(g.dtype)
    return (g.float() * scale.float()).to(g.dtype)


def _bwd(ctx, dloss, dlogp, dent, *_stats):
    tail = (None,) * 11
    if ctx.grads:
        dh, dw, db = ctx.saved_tensors
        if dloss is None:
            return (None, None, None) + tail
        return (_scaled(dh, dloss), _scaled(dw, dloss), _scaled(db, dloss) if ctx.has_bias else None) + tail
    hidden, weight, bias, labels, lse, ent = ctx.saved_tensors
    # outputs nobody used may come back as None; the backward op takes tensors (and ignores the
    # gradients of outputs the caller did not ask for)
    n, dt, reduction = hidden.shape[0], _stat_dtype(hidden), ctx.args[4]
    dloss = hidden.new_zeros((n,) if reduction == "none" else (), dtype=dt) if dloss is None else dloss
    dlogp = hidden.new_zeros((n,), dtype=dt) if dlogp is None else dlogp
    dent = hidden.new_zeros((n,), dtype=dt) if dent is None else dent
    dh, dw, db = fused_linear_cross_entropy_backward(dloss, dlogp, dent, hidden, weight,
                                                     bias if ctx.has_bias else None, labels, lse, ent, *ctx.args)
    return (dh, dw, db if ctx.has_bias else None) + tail


fused_linear_cross_entropy_op.register_autograd(_bwd, setup_context=_setup)


def fused_linear_cross_entropy(hidden, weight, bias, labels, ignore_index, label_smoothing, softcap, temperature,
                               reduction, return_logps, return_entropy, chunk_size, backend):
    """The op's (loss, logps, entropy), for the public function under torch.compile; asks the op for
    the loss-only gradients in its forward when autograd will want them."""
    grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    return fused_linear_cross_entropy_op(hidden, weight, bias, labels, ignore_index, label_smoothing, softcap,
                                         temperature, reduction, return_logps, return_entropy, chunk_size, backend,
                                         grads)[:3]


OPS = ("fused_linear_cross_entropy",)
