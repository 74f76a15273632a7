"""Fused linear cross-entropy: the LM head ``hidden @ weight.T`` and its loss (plus per-token
log-probs and entropy) without ever holding the [N, V] logits.

Backends: ``reference`` (:mod:`.reference`, unfused), ``cpu`` (C++ in ``csrc/loss``, :mod:`._cpu`),
``triton`` (:mod:`._triton`), ``npu`` (the chunked torch path of :mod:`._chunked` on Ascend
devices: torch_npu has no fused linear cross-entropy operator). The algorithm and its two
gradient modes are described in :mod:`._chunked`.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .. import _checks, _dispatch
from .._verifiers import by_first, cpu_reason, dtype_reason, triton_reason
from . import _library
from ._chunked import Params, default_chunk
from .jsd import fused_linear_jsd, linear_jsd_reference
from .reference import fused_linear_cross_entropy_reference
from .vocab_parallel import vocab_parallel_fused_linear_cross_entropy

__all__ = ["fused_linear_cross_entropy", "fused_linear_cross_entropy_reference", "fused_linear_jsd",
           "linear_jsd_reference", "vocab_parallel_fused_linear_cross_entropy"]

_OP = _dispatch.op("fused_linear_cross_entropy")
_REDUCTIONS = ("mean", "sum", "none")


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                               bias: Optional[torch.Tensor] = None, ignore_index: int = -100,
                               reduction: str = "mean", label_smoothing: float = 0.0,
                               logit_softcap: Optional[float] = None, temperature: float = 1.0,
                               return_logps: bool = False, return_entropy: bool = False,
                               chunk_size: Optional[int] = None, backend: Optional[str] = None,
                               expected_logps_grad: Optional[torch.Tensor] = None):
    """Cross entropy of ``z = softcap((hidden @ weight.T + bias) / temperature)`` against ``labels``.

    The same value as ``F.cross_entropy(z, labels, ignore_index=, reduction=, label_smoothing=)``
    (so ``mean`` over labels that are all ``ignore_index`` is NaN, with zero gradients, as in
    torch), computed ``chunk_size`` tokens at a time: the logits of one chunk exist at once,
    never all N rows; statistics are fp32, weight/bias gradients are accumulated in fp32.

    Args:
        hidden: ``[..., H]`` (``[N, H]`` after flattening), float32 / bfloat16 / float16
            (float64 runs on the reference).
        weight: ``[V, H]``, hidden's dtype (the LM head / tied embedding).
        labels: integer ``[...]`` (hidden's leading dims) or ``[N]``; each in ``[0, V)`` or
            ``ignore_index``. Not shifted here: pass labels aligned with ``hidden``.
        bias: optional ``[V]``, hidden's dtype.
        reduction: ``"mean"`` (over non-ignored labels), ``"sum"`` or ``"none"`` (per token,
            0 on ignored ones). With every label ignored: ``none`` gives zeros, ``sum`` 0, and
            ``mean`` torch's 0 / 0 = NaN (``F.cross_entropy``'s value); the gradients are zeros
            in all three, as torch's.
        label_smoothing: in ``[0, 1]``, torch's definition.
        logit_softcap: Gemma's ``cap * tanh(z / cap)``, applied after the temperature.
        temperature: divides the logits before anything else (softcap, softmax).
        return_logps: also return per-token ``log p(label)``, fp32 ``[...]``, 0 on ignored
            tokens; differentiable.
        return_entropy: also return the entropy of the softmax, fp32 ``[...]``, 0 on ignored
            tokens; differentiable (the entropy's gradient flows when the returned entropy is used).
        chunk_size: tokens per chunk (default: an fp32 chunk of logits of about 128 MB; on the
            cpu backend in bf16 / fp16, all tokens up to 16384, the vocabulary then going in
            blocks of about 8M logits, and so in fp32 in the loss-only mode when the weight's
            gradient has room for those blocks, about N <= H).
        backend: ``None``/"auto", "reference", "cpu", "triton" or "npu".
        expected_logps_grad: optional float ``[...]`` (labels' shape) or ``[N]``, with
            ``return_logps`` and without ``return_entropy``: the gradient the returned logps are
            expected to get, up to one scalar factor (e.g. ``-mask`` for a masked token-sum or
            token-mean NLL). The forward then computes the gradients for it while the logits are
            at hand (three GEMMs in all, as the loss-only mode, instead of four), and a backward
            whose logps gradient is exactly ``s * expected_logps_grad`` for one scalar ``s`` (the
            loss and entropy getting none) uses them, scaled by ``s``; any other backward recomputes
            as without it (the forward's extra work then wasted). A speed hint only: the gradients
            are the same either way (up to the scaling's rounding). Not used by the reference
            backend, under ``torch.compile``, or without a gradient to compute.

    Returns the loss (fp32; fp64 for fp64 inputs), or ``(loss, logps?, entropy?)`` with only
    the asked ones, when ``return_logps`` or ``return_entropy``. Differentiable in hidden,
    weight and bias.

    Example::

        loss = fused_linear_cross_entropy(h.view(-1, 2560), lm_head.weight, labels.view(-1))
        loss, logps, ent = fused_linear_cross_entropy(h, w, y, reduction="none",
                                                      return_logps=True, return_entropy=True)
    """
    _checks.tensor("hidden", hidden, ndim_min=1)
    _checks.tensor("weight", weight)
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must have shape [V, {hidden.shape[-1]}] (H = the last dim of hidden), "
                         f"got {tuple(weight.shape)}")
    V, H = weight.shape
    if V == 0:
        raise ValueError("weight must have at least one row (V >= 1)")
    _checks.same_dtype(("hidden", "weight"), (hidden, weight))
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor, got {labels.dtype}")
    N = math.prod(hidden.shape[:-1])
    if labels.shape != hidden.shape[:-1] and tuple(labels.shape) != (N,):
        raise ValueError(f"labels must have shape {tuple(hidden.shape[:-1])} (hidden's leading dims) or [{N}], "
                         f"got {tuple(labels.shape)}")
    if bias is not None:
        _checks.tensor("bias", bias)
        if tuple(bias.shape) != (V,):
            raise ValueError(f"bias must have shape [{V}] (weight's rows), got {tuple(bias.shape)}")
        _checks.same_dtype(("weight", "bias"), (weight, bias))
    _checks.same_device(("hidden", "weight", "labels", "bias"), (hidden, weight, labels, bias))
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    label_smoothing = _checks.finite_float("label_smoothing", label_smoothing)
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    softcap = None if logit_softcap is None else _checks.positive_float("logit_softcap", logit_softcap)
    temperature = _checks.positive_float("temperature", temperature)
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size <= 0):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    y = labels.reshape(N).to(torch.int64)
    logp_grad = _expected_logps_grad(expected_logps_grad, labels, N, hidden.device, return_logps, return_entropy)
    compiling = torch.compiler.is_compiling()
    if not compiling:  # under torch.compile the op checks the labels' values when it runs
        _library.check_labels(y, V, ignore_index)

    h2 = hidden.reshape(N, H)
    if not h2.is_contiguous():
        h2 = h2.contiguous()
    w = weight if weight.is_contiguous() else weight.contiguous()
    params = Params(ignore_index, label_smoothing, softcap or 0.0, temperature)
    y = y.contiguous()
    # chunk_size None (0 through the custom op): each backend picks its own (the cpu backend's bf16
    # path takes all tokens at once)
    if compiling:  # one opaque op in the graph; the dispatch runs inside it
        loss, logp, ent = _library.fused_linear_cross_entropy(
            h2, w, bias, y, ignore_index, label_smoothing, softcap or 0.0, temperature, reduction, return_logps,
            return_entropy, chunk_size or 0, backend)
    else:
        loss, logp, ent = _OP(hidden.device, backend, h2, w, bias, y, params, reduction, return_logps,
                              return_entropy, chunk_size, logp_grad)
    if not (return_logps or return_entropy):
        return loss.view(labels.shape) if reduction == "none" else loss
    out = [loss.view(labels.shape) if reduction == "none" else loss]
    if return_logps:
        out.append(logp.view(labels.shape))
    if return_entropy:
        out.append(ent.view(labels.shape))
    return tuple(out)


def _expected_logps_grad(g, labels, n: int, device, return_logps: bool, return_entropy: bool):
    """``expected_logps_grad`` checked, as a contiguous fp32 [N] tensor (or None)."""
    if g is None:
        return None
    if not isinstance(g, torch.Tensor) or not g.dtype.is_floating_point:
        raise TypeError(f"expected_logps_grad must be a floating-point torch.Tensor, got "
                        f"{g.dtype if isinstance(g, torch.Tensor) else type(g).__name__}")
    if not return_logps or return_entropy:
        raise ValueError("expected_logps_grad needs return_logps=True and return_entropy=False")
    if g.shape != labels.shape and tuple(g.shape) != (n,):
        raise ValueError(f"expected_logps_grad must have labels' shape {tuple(labels.shape)} or [{n}], "
                         f"got {tuple(g.shape)}")
    if g.device != device:
        raise ValueError(f"expected_logps_grad must be on hidden's device {device}, got {g.device}")
    return g.detach().reshape(n).to(torch.float32).contiguous()


# -- backends ---------------------------------------------------------------------------------

def _reference(h, w, b, y, p: Params, reduction, want_logps, want_ent, chunk, logp_grad=None):
    loss, logp, ent = fused_linear_cross_entropy_reference(
        h, w, y, bias=b, ignore_index=p.ignore_index, reduction=reduction, label_smoothing=p.label_smoothing,
        logit_softcap=p.softcap or None, temperature=p.temperature, return_logps=True, return_entropy=True)
    return loss, logp, ent


_OP.register("reference")(_reference)


def _npu_reason(h, *rest):
    # the chunked torch path: any NPU tensor of a fast dtype (no torch_npu operator involved)
    if h.device.type != "npu":
        return f"the npu backend needs NPU tensors (got {h.device.type})"
    return dtype_reason(h)


def _cpu_reason(h, *rest):
    from . import _cpu
    return cpu_reason(h) or _cpu.stale_reason()
_triton_reason = by_first(triton_reason)


def _cpu_engine(h, w, chunk):
    from . import _cpu as cpu
    return cpu.ENGINE, chunk or 0   # 0: the C++ kernels choose (linear_ce._cpu)


def _triton_engine(h, w, chunk):
    from . import _triton as tri
    return tri.ENGINE, chunk or default_chunk(h.shape[0], w.shape[0], h.dtype)


def _npu_engine(h, w, chunk):
    from . import _chunked
    return _chunked.TORCH_ENGINE, chunk or default_chunk(h.shape[0], w.shape[0], h.dtype)


def _runner(engine_of):
    def run(h, w, b, y, p, reduction, want_logps, want_ent, chunk, logp_grad=None):
        from . import _chunked
        engine, chunk = engine_of(h, w, chunk)
        return _chunked.apply(engine, h, w, b, y, p, reduction, want_logps, want_ent, chunk, logp_grad)
    return run


for _b, _verify, _engine_of in (("cpu", _cpu_reason, _cpu_engine), ("triton", _triton_reason, _triton_engine),
                                ("npu", _npu_reason, _npu_engine)):
    _OP.register(_b, verify=_verify)(_runner(_engine_of))
    # the same chunk loop split in two, for the custom op under torch.compile (_library)
    _OP.register_stages(_b, *_library.chunked_stages(_engine_of))
del _b, _verify, _engine_of
