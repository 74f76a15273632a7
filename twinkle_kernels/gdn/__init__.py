"""Gated DeltaNet ops (Qwen3.5 / Qwen3-Next linear attention): the gated delta rule in its
chunked (training) and fused recurrent (decoding) forms, and the depthwise causal conv1d.

Backends: ``reference`` (:mod:`.reference`, the token-by-token recurrence), ``cpu`` (C++ in
``csrc/gdn``, :mod:`._cpu`), ``triton`` (:mod:`._triton`, CUDA GPUs) and ``npu``
(:mod:`twinkle_kernels.gdn._npu`, through triton-ascend).

Context parallelism (:mod:`.cp`): :func:`chunk_gated_delta_rule_cp` and :func:`causal_conv1d_cp`
run over a packed stream split between the ranks of a group (megatron's zigzag split:
:func:`zigzag_segments`), with the unsplit ops' results; they run on whichever backend serves the
local calls.

Layout (flash-linear-attention's)::

    q, k:           [B, T, H, K]
    v:              [B, T, HV, V]       HV % H == 0; value head j reads key head j // (HV // H)
    g, beta:        [B, T, HV]          g is the log-space decay, beta the write strength
    initial_state:  [N, HV, K, V]       N = B, or the number of packed sequences
    cu_seqlens:     [N + 1] int32/int64 packed sequences along T (B must be 1); no state crosses
                                        a boundary, lengths need not be multiples of chunk_size,
                                        and empty sequences (repeated offsets) are allowed
"""
from __future__ import annotations

import importlib
from typing import Optional, Tuple

import torch

from .. import _dispatch
from .._verifiers import FORWARD_ONLY, cpu_reason, needs_grad, triton_reason
from . import _args, _library
from . import _npu as npu_gdn
from ._args import SUPPORTED_CHUNK_SIZES
from .reference import (causal_conv1d_reference, causal_conv1d_update_reference,
                        gated_delta_rule_reference, l2norm)
from .cp import causal_conv1d_cp, chunk_gated_delta_rule_cp, zigzag_segments

__all__ = [
    "chunk_gated_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "causal_conv1d",
    "causal_conv1d_update",
    "chunk_gated_delta_rule_cp",
    "causal_conv1d_cp",
    "zigzag_segments",
    "gated_delta_rule_reference",
    "causal_conv1d_reference",
    "causal_conv1d_update_reference",
    "l2norm",
    "SUPPORTED_CHUNK_SIZES",
]

_CHUNK = _dispatch.op("chunk_gated_delta_rule")
_RECUR = _dispatch.op("fused_recurrent_gated_delta_rule")
_CONV = _dispatch.op("causal_conv1d")
_CONV_UPDATE = _dispatch.op("causal_conv1d_update")


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, scale: Optional[float] = None,
                           initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
                           use_qk_l2norm_in_kernel: bool = False, cu_seqlens: Optional[torch.Tensor] = None,
                           *, chunk_size: int = 64,
                           backend: Optional[str] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Gated delta rule over whole sequences (training), computed chunk by chunk.

    Per value head, with the state ``S [K, V]`` and token t::

        S = S * exp(g_t);  S = S + beta_t * k_t (v_t - S^T k_t)^T;  o_t = scale * S^T q_t

    Args:
        q: ``[B, T, H, K]``; q, k and v have the same dtype (float32 / bfloat16 / float16;
            float64 runs on the reference).
        k: ``[B, T, H, K]``.
        v: ``[B, T, HV, V]``.
        g: ``[B, T, HV]`` log-space decay (any float dtype; read in fp32).
        beta: ``[B, T, HV]`` write strength (any float dtype; read in fp32).
        scale: read-out scale, default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (any float dtype; used in fp32), or None for zeros.
        output_final_state: also return the state after the last token of each sequence.
        use_qk_l2norm_in_kernel: L2-normalise q and k over K inside the op
            (``x / sqrt(sum(x**2) + 1e-6)``, as fla and transformers).
        cu_seqlens: ``[N + 1]`` int offsets of packed sequences; B must be 1.
        chunk_size: one of :data:`SUPPORTED_CHUNK_SIZES`; the result does not depend on it
            beyond rounding.
        backend: ``None``/"auto", "reference", "cpu" or "triton".

    Returns ``(o, final_state)``: ``o [B, T, HV, V]`` in v's dtype and ``final_state
    [N, HV, K, V]`` fp32 (None unless ``output_final_state``). Differentiable in q, k, v, g, beta
    and initial_state, through both outputs.

    Example::

        o, s = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True)
    """
    compiling = torch.compiler.is_compiling()
    scale = _args.gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                                   use_qk_l2norm_in_kernel, cu_seqlens, chunk_size, values=not compiling)
    if compiling:  # one opaque op in the graph; the dispatch (and the offsets' value check) run inside it
        o, s = _library.chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                                                   use_qk_l2norm_in_kernel, cu_seqlens, chunk_size, backend)
        return o, (s if output_final_state else None)
    return _CHUNK(q.device, backend, q, k, v, g, beta, scale, initial_state, output_final_state,
                  use_qk_l2norm_in_kernel, cu_seqlens, chunk_size)


def fused_recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                     beta: torch.Tensor, scale: Optional[float] = None,
                                     initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
                                     use_qk_l2norm_in_kernel: bool = False,
                                     cu_seqlens: Optional[torch.Tensor] = None, *,
                                     backend: Optional[str] = None
                                     ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The same gated delta rule, token by token: the decoding form (forward only).

    Arguments and results as :func:`chunk_gated_delta_rule` (no chunk size). Carry the state
    between decode steps by passing the returned ``final_state`` as the next ``initial_state``.
    The fast backends serve the forward only; with gradients required the call falls back to
    the reference (autograd through the loop).
    """
    compiling = torch.compiler.is_compiling()
    scale = _args.gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                                   use_qk_l2norm_in_kernel, cu_seqlens, values=not compiling)
    if compiling:
        o, s = _library.fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale, initial_state,
                                                             output_final_state, use_qk_l2norm_in_kernel,
                                                             cu_seqlens, backend)
        return o, (s if output_final_state else None)
    return _RECUR(q.device, backend, q, k, v, g, beta, scale, initial_state, output_final_state,
                  use_qk_l2norm_in_kernel, cu_seqlens, None)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  activation: Optional[str] = "silu", cu_seqlens: Optional[torch.Tensor] = None, *,
                  backend: Optional[str] = None) -> torch.Tensor:
    """Depthwise causal conv1d in transformers' ``causal_conv1d_fn`` layout.

    ``y[b, d, t] = act(bias[d] + sum_i weight[d, i] * x[b, d, t - W + 1 + i])``, zero before the
    start of the sequence.

    Args:
        x: ``[B, D, T]`` float32 / bfloat16 / float16 (float64 on the reference).
        weight: ``[D, W]``; bias: ``[D]`` or None (any float dtype; read in fp32).
        activation: None or "silu" ("swish" is an alias).
        cu_seqlens: ``[N + 1]`` int offsets along T of packed sequences (B must be 1); no token
            sees a token of another sequence.

    Returns ``[B, D, T]`` in x's dtype; differentiable in x, weight and bias.
    """
    compiling = torch.compiler.is_compiling()
    act = _args.causal_conv1d(x, weight, bias, activation, cu_seqlens, values=not compiling)
    if compiling:
        return _library.causal_conv1d(x, weight, bias, act, cu_seqlens, backend)
    return _CONV(x.device, backend, x, weight, bias, act, cu_seqlens)


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         bias: Optional[torch.Tensor] = None, activation: Optional[str] = None, *,
                         backend: Optional[str] = None) -> torch.Tensor:
    """Decode step of :func:`causal_conv1d` with a rolling state (transformers' ``causal_conv1d_update``).

    Args:
        x: ``[B, D, S]`` new tokens (``[B, D]`` for one).
        conv_state: ``[B, D, L]``, ``L >= W - 1``, the last L inputs; **updated in place** to the
            last L columns of ``cat(conv_state, x)``.
        weight: ``[D, W]``; bias: ``[D]`` or None; activation: None (default, as transformers) or "silu".

    Returns ``[B, D, S]`` (``[B, D]``) in x's dtype. Forward only.
    """
    act = _args.causal_conv1d_update(x, conv_state, weight, bias, activation)
    if torch.compiler.is_compiling():
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
            # torch.library has no autograd for ops that mutate an input: trace the pure-torch reference
            return causal_conv1d_update_reference(x, conv_state, weight, bias, act)
        return _library.causal_conv1d_update(x, conv_state, weight, bias, act, backend)
    return _CONV_UPDATE(x.device, backend, x, conv_state, weight, bias, act)


# -- reference ------------------------------------------------------------------------------------
def _gdr_reference(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                   cu_seqlens, chunk_size):
    return gated_delta_rule_reference(q, k, v, g, beta, scale, initial_state, output_final_state,
                                      use_qk_l2norm_in_kernel, cu_seqlens)


_CHUNK.register("reference")(_gdr_reference)
_RECUR.register("reference")(_gdr_reference)
_CONV.register("reference")(causal_conv1d_reference)
_CONV_UPDATE.register("reference")(causal_conv1d_update_reference)


# -- verifiers --------------------------------------------------------------------------------------
def _cpu_op_reason(name: str) -> Optional[str]:
    from .. import _cpu_ext
    why = _cpu_ext.unavailable_reason()
    if why is None and not hasattr(_cpu_ext.ops(), name):
        why = f"the C++ extension was built without {name} (rebuild it)"
    return why


def _cpu_reason_for(op_name: str):
    def verify(t, *rest):
        return cpu_reason(t) or _cpu_op_reason(op_name)
    return verify


def _recurrent_cpu_reason(q, k, v, g, beta, scale, initial_state, *rest):
    if needs_grad(q, k, v, g, beta, initial_state):
        return FORWARD_ONLY
    return _cpu_reason_for("gdn_recurrent_fwd")(q)


def _conv_update_cpu_reason(x, conv_state, weight, bias, *rest):
    if needs_grad(x, weight, bias):
        return "the decode step is forward only here; gradients are served by the reference"
    return _cpu_reason_for("causal_conv1d_update_fwd")(x)


def _triton_fn(name: str):
    """The function ``name`` of :mod:`._triton`, or the reason it cannot be had."""
    try:
        mod = importlib.import_module(f"{__name__}._triton")
    except Exception as e:  # not written yet, or a broken triton install
        return None, f"twinkle_kernels.gdn._triton is not importable ({type(e).__name__}: {e})"
    fn = getattr(mod, name, None)
    if fn is None:
        return None, f"twinkle_kernels.gdn._triton has no {name}"
    return fn, None


def _triton_reason_for(name: str, forward_only: bool = False):
    def verify(t, *rest):
        if forward_only and needs_grad(t, *rest[:4], rest[5]):
            return FORWARD_ONLY
        why = triton_reason(t)
        if why is None:
            why = _triton_fn(name)[1]
        if why is None and name != "causal_conv1d":
            # shape limits of the chunked kernels (K <= 256): fall back instead of raising inside
            why = _triton_fn("unsupported_reason")[0](t, rest[1])
        return why
    return verify


# -- cpu ------------------------------------------------------------------------------------------
@_CHUNK.register("cpu", verify=_cpu_reason_for("gdn_chunk_fwd"))
def _chunk_cpu(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
               cu_seqlens, chunk_size):
    from . import _cpu
    return _cpu.chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                                       use_qk_l2norm_in_kernel, cu_seqlens, chunk_size)


@_RECUR.register("cpu", verify=_recurrent_cpu_reason)
def _recurrent_cpu(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                   cu_seqlens, chunk_size):
    from . import _cpu
    return _cpu.fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                                                 use_qk_l2norm_in_kernel, cu_seqlens)


@_CONV.register("cpu", verify=_cpu_reason_for("causal_conv1d_fwd"))
def _conv_cpu(x, weight, bias, activation, cu_seqlens):
    from . import _cpu
    return _cpu.causal_conv1d(x, weight, bias, activation, cu_seqlens)


@_CONV_UPDATE.register("cpu", verify=_conv_update_cpu_reason)
def _conv_update_cpu(x, conv_state, weight, bias, activation):
    from . import _cpu
    return _cpu.causal_conv1d_update(x, conv_state, weight, bias, activation)


# -- triton (twinkle_kernels.gdn._triton, imported only when a call asks for it) --------------------
@_CHUNK.register("triton", verify=_triton_reason_for("chunk_gated_delta_rule"))
def _chunk_triton(*args):
    return _triton_fn("chunk_gated_delta_rule")[0](*args)


@_RECUR.register("triton", verify=_triton_reason_for("fused_recurrent_gated_delta_rule", forward_only=True))
def _recurrent_triton(*args):
    return _triton_fn("fused_recurrent_gated_delta_rule")[0](*args)


@_CONV.register("triton", verify=_triton_reason_for("causal_conv1d"))
def _conv_triton(*args):
    return _triton_fn("causal_conv1d")[0](*args)


# The conv's backward kernels for its custom op under torch.compile (_library): it saves only
# its inputs. The delta rule's custom ops still rerun the forward (see _library).
for _b in ("cpu", "triton"):
    _CONV.register_stages(_b, None, _dispatch.lazy(f"{__name__}._{_b}", "causal_conv1d_backward"))
del _b

# -- npu (Triton kernels compiled by triton-ascend: fla's, else twinkle's; see twinkle_kernels.gdn._npu)
_CHUNK.register("npu", verify=npu_gdn.chunk_reason)(npu_gdn.chunk_gated_delta_rule)
_RECUR.register("npu", verify=npu_gdn.recurrent_reason)(npu_gdn.fused_recurrent_gated_delta_rule)
