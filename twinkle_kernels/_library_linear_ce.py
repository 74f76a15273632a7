"""The fused linear cross-entropy as a ``torch.library`` custom op (see :mod:`twinkle_kernels._library`).

``twinkle::fused_linear_cross_entropy(hidden [N, H], weight [V, H], bias [V]?, labels int64 [N], ...)
-> (loss, logps [N], entropy [N])``: loss ``[]`` (``reduction="none"``: ``[N]``); all three fp32 (fp64 for
fp64 inputs). Every backend computes logps and entropy anyway, so they are always returned and the
public function keeps only the asked ones (no optional outputs, no dynamic sizes).

The label range check reads the labels: under ``torch.compile`` it runs inside the op, with the same
ValueError as an eager call. The backward op reruns the selected backend's forward with autograd and
takes its vector-Jacobian product, skipping the outputs the caller did not ask for (so the backend's
cheaper gradient mode stays in use). That is one more chunked forward, never the [N, V] logits.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ._library import NS, _dispatch, _new, _vjp


def check_labels(y: torch.Tensor, num_classes: int, ignore_index: int) -> None:
    """y: int64 ``[N]``; each label in ``[0, num_classes)`` or ``ignore_index``."""
    bad = ((y < 0) | (y >= num_classes)) & (y != ignore_index)
    if y.numel() and bool(bad.any()):
        first = int(y[bad][0])
        raise ValueError(f"labels must be in [0, {num_classes}) (weight's rows) or ignore_index={ignore_index}; "
                         f"got {first}")


def _run(h, w, b, y, ignore_index, label_smoothing, softcap, temperature, reduction, want_logps, want_ent, chunk,
         backend):
    from .linear_ce._chunked import Params
    params = Params(ignore_index, label_smoothing, softcap, temperature)
    return _dispatch("fused_linear_cross_entropy")(h.device, backend, h, w, b, y, params, reduction, want_logps,
                                                   want_ent, chunk)


def _stat_dtype(h: torch.Tensor) -> torch.dtype:
    return torch.float64 if h.dtype == torch.float64 else torch.float32


@torch.library.custom_op(f"{NS}::fused_linear_cross_entropy", mutates_args=())
def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                               labels: torch.Tensor, ignore_index: int, label_smoothing: float, softcap: float,
                               temperature: float, reduction: str, return_logps: bool, return_entropy: bool,
                               chunk_size: int, backend: Optional[str]
                               ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_labels(labels, weight.shape[0], ignore_index)
    loss, logp, ent = _run(hidden, weight, bias, labels, ignore_index, label_smoothing, softcap, temperature,
                           reduction, return_logps, return_entropy, chunk_size, backend)
    return loss.contiguous(), logp.contiguous(), ent.contiguous()


@fused_linear_cross_entropy.register_fake
def _(hidden, weight, bias, labels, ignore_index, label_smoothing, softcap, temperature, reduction, return_logps,
      return_entropy, chunk_size, backend):
    dt = _stat_dtype(hidden)
    n = hidden.shape[0]
    loss = hidden.new_empty((n,) if reduction == "none" else (), dtype=dt)
    return loss, hidden.new_empty((n,), dtype=dt), hidden.new_empty((n,), dtype=dt)


@torch.library.custom_op(f"{NS}::fused_linear_cross_entropy_backward", mutates_args=())
def fused_linear_cross_entropy_backward(
        dloss: torch.Tensor, dlogp: torch.Tensor, dent: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
        bias: Optional[torch.Tensor], labels: torch.Tensor, ignore_index: int, label_smoothing: float, softcap: float,
        temperature: float, reduction: str, return_logps: bool, return_entropy: bool, chunk_size: int,
        backend: Optional[str]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    def f(h, w, *b):
        return _run(h, w, b[0] if b else None, labels, ignore_index, label_smoothing, softcap, temperature,
                    reduction, return_logps, return_entropy, chunk_size, backend)
    inputs = (hidden, weight) if bias is None else (hidden, weight, bias)
    grads = (dloss, dlogp if return_logps else None, dent if return_entropy else None)
    got = tuple(t.contiguous() for t in _vjp(f, inputs, grads, tuple(range(len(inputs)))))
    return got if bias is not None else (*got, hidden.new_empty((0,)))


@fused_linear_cross_entropy_backward.register_fake
def _(dloss, dlogp, dent, hidden, weight, bias, *rest):
    return _new(hidden), _new(weight), (_new(bias) if bias is not None else hidden.new_empty((0,)))


def _setup(ctx, inputs, output):
    hidden, weight, bias, labels, *ctx.args = inputs
    ctx.has_bias = bias is not None
    ctx.save_for_backward(hidden, weight, bias, labels)


def _bwd(ctx, dloss, dlogp, dent):
    hidden, weight, bias, labels = ctx.saved_tensors
    # outputs nobody used may come back as None; the backward op takes tensors (and ignores the
    # gradients of outputs the caller did not ask for)
    n, dt, reduction = hidden.shape[0], _stat_dtype(hidden), ctx.args[4]
    dloss = hidden.new_zeros((n,) if reduction == "none" else (), dtype=dt) if dloss is None else dloss
    dlogp = hidden.new_zeros((n,), dtype=dt) if dlogp is None else dlogp
    dent = hidden.new_zeros((n,), dtype=dt) if dent is None else dent
    dh, dw, db = fused_linear_cross_entropy_backward(dloss, dlogp, dent, hidden, weight,
                                                     bias if ctx.has_bias else None, labels, *ctx.args)
    return (dh, dw, db if ctx.has_bias else None) + (None,) * 10


fused_linear_cross_entropy.register_autograd(_bwd, setup_context=_setup)

OPS = ("fused_linear_cross_entropy",)
