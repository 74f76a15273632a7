"""Mixture-of-experts: grouped matmul, token routing and the Hugging Face experts function.

Backends of :func:`grouped_matmul`: ``reference`` (a loop, :mod:`.reference`), ``cpu``
(one C++ op over experts x tiles, or ``torch._grouped_mm`` where measured faster,
:mod:`._cpu`) and ``triton`` (one launch for all experts, :mod:`._triton`).
:func:`moe_experts` on ``cpu`` / ``triton`` is routing + two grouped matmuls + SwiGLU +
weighted un-permute; on ``reference`` it is the loop of Hugging Face's eager experts.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import _checks, _dispatch
from .._verifiers import by_first, cpu_reason, triton_reason
from .. import _activations
from . import _library
from . import _npu as npu_moe
from ._values import check_expert_ids, check_offset_values
from .reference import grouped_matmul_reference, moe_experts_reference
from .routing import RoutingPlan, make_routing_plan, permute_tokens, unpermute_tokens

__all__ = ["grouped_matmul", "grouped_matmul_backward", "moe_experts", "grouped_matmul_reference", "moe_experts_reference",
           "RoutingPlan", "make_routing_plan", "permute_tokens", "unpermute_tokens"]

_GMM = _dispatch.op("grouped_matmul")
_MOE = _dispatch.op("moe_experts")
_INT_DTYPES = (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)


# -- argument checks --------------------------------------------------------------------------
def _check_offsets(offsets, num_experts: int, num_rows: int, device, values: bool = True) -> None:
    """``values=False`` checks type, shape and device only: under torch.compile the values are
    checked inside the op (reading them here would break the graph)."""
    if not isinstance(offsets, torch.Tensor):
        raise TypeError(f"offsets must be a torch.Tensor, got {type(offsets).__name__}")
    if offsets.dtype != torch.int32:
        raise TypeError(f"offsets must be int32 (cumulative end rows, torch._grouped_mm 'offs'), got {offsets.dtype}")
    if offsets.dim() != 1 or offsets.shape[0] != num_experts:
        raise ValueError(f"offsets must have shape [{num_experts}] (one end row per expert of w), "
                         f"got {tuple(offsets.shape)}")
    if offsets.device != device:
        raise ValueError(f"offsets is on {offsets.device} but x is on {device}; all inputs must share a device")
    if values:
        check_offset_values(offsets, num_rows)


def _check_gmm(x, w, offsets, values: bool = True) -> None:
    _checks.tensor("x", x)
    _checks.tensor("w", w)
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got shape {tuple(x.shape)}")
    if w.dim() != 3:
        raise ValueError(f"w must be [E, K, N], got shape {tuple(w.shape)}")
    if w.shape[0] == 0:
        raise ValueError("w must have at least one expert (E >= 1)")
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"w has K = w.shape[1] = {w.shape[1]} but x has K = x.shape[1] = {x.shape[1]}; they must match")
    _checks.same_dtype(("x", "w"), (x, w))
    _checks.same_device(("x", "w"), (x, w))
    _check_offsets(offsets, w.shape[0], x.shape[0], x.device, values)


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, *,
                   backend: Optional[str] = None) -> torch.Tensor:
    """Grouped matmul: ``y[offsets[e-1]:offsets[e]] = x[offsets[e-1]:offsets[e]] @ w[e]``.

    Args:
        x: ``[M, K]``, rows grouped by expert; float32 / bfloat16 / float16
            (float64 runs on the reference).
        w: ``[E, K, N]``, same dtype as x. Any strides: ``proj.transpose(1, 2)`` of a
            Hugging Face ``[E, N, K]`` weight works without a copy, and its gradient
            comes back in the same layout.
        offsets: int32 ``[E]``, cumulative end rows, non-decreasing, ``offsets[-1] == M``
            (the ``offs`` of ``torch._grouped_mm``); groups may be empty.
        backend: ``None``/"auto", "reference", "cpu" or "triton".

    Returns ``[M, N]`` in x's dtype (fp32 accumulation). Differentiable in x and w; an
    expert with no rows gets a zero gradient.

    Example::

        offsets = torch.tensor([3, 3, 8], dtype=torch.int32)     # 3 rows, 0 rows, 5 rows
        y = grouped_matmul(torch.randn(8, 16), torch.randn(3, 16, 32), offsets)
    """
    compiling = torch.compiler.is_compiling()
    _check_gmm(x, w, offsets, values=not compiling)
    if compiling:  # one opaque op in the graph; the dispatch (and the offsets' value check) run inside it
        return _library.grouped_matmul(x, w, offsets, backend)
    return _GMM(x.device, backend, x, w, offsets)


def grouped_matmul_backward(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, *,
                            backend: Optional[str] = None):
    """The gradients of :func:`grouped_matmul` ``(x, w, offsets)`` for the output gradient ``dy``.

    For callers that wrap the grouped matmul in an autograd Function of their own (to choose what
    is saved for the backward) and must not rerun its forward there. ``dy``: ``[M, N]``; ``x``,
    ``w``, ``offsets``, ``backend`` as for :func:`grouped_matmul`. Returns ``(dx [M, K], dw
    [E, K, N])`` in x's dtype (zero ``dw[e]`` for an empty group): the backend's own backward
    kernels where it has them (cpu, triton: dx is one grouped matmul with ``w`` transposed, dw one
    grouped ``x^T dy`` written in w's own strides, as :func:`grouped_matmul`'s autograd gives
    it), else the vector-Jacobian product of its forward. Under ``torch.compile`` one opaque op
    (contiguous results).
    """
    compiling = torch.compiler.is_compiling()
    _check_gmm(x, w, offsets, values=not compiling)
    _checks.tensor("dy", dy)
    if tuple(dy.shape) != (x.shape[0], w.shape[2]):
        raise ValueError(f"dy must be [M, N] = {(x.shape[0], w.shape[2])} (x's rows, w's columns), "
                         f"got {tuple(dy.shape)}")
    if compiling:
        return _library.grouped_matmul_backward(dy.to(x.dtype), x, w, offsets, backend)
    return _library.grouped_matmul_vjp(dy.to(x.dtype), x, w, offsets, backend)


def _check_moe(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, values: bool = True) -> None:
    _checks.tensor("hidden_states", hidden_states)
    _checks.tensor("top_k_weights", top_k_weights)
    _checks.tensor("gate_up_proj", gate_up_proj)
    _checks.tensor("down_proj", down_proj)
    _checks.tensor("top_k_index", top_k_index, float_only=False)
    if top_k_index.dtype not in _INT_DTYPES:
        raise TypeError(f"top_k_index must be an integer tensor, got {top_k_index.dtype}")
    if hidden_states.dim() != 2:
        raise ValueError(f"hidden_states must be [T, H], got shape {tuple(hidden_states.shape)}")
    t, h = hidden_states.shape
    if top_k_index.dim() != 2 or top_k_index.shape[0] != t:
        raise ValueError(f"top_k_index must be [T, k] with T = {t} (hidden_states.shape[0]), "
                         f"got {tuple(top_k_index.shape)}")
    if top_k_weights.shape != top_k_index.shape:
        raise ValueError(f"top_k_weights must have the shape of top_k_index {tuple(top_k_index.shape)}, "
                         f"got {tuple(top_k_weights.shape)}")
    if gate_up_proj.dim() != 3 or gate_up_proj.shape[2] != h or gate_up_proj.shape[1] % 2:
        raise ValueError(f"gate_up_proj must be [E, 2I, H] with H = {h}, got {tuple(gate_up_proj.shape)}")
    e, two_i = gate_up_proj.shape[0], gate_up_proj.shape[1]
    if e == 0:
        raise ValueError("gate_up_proj must have at least one expert (E >= 1)")
    if down_proj.shape != (e, h, two_i // 2):
        raise ValueError(f"down_proj must be [E, H, I] = {(e, h, two_i // 2)} to match gate_up_proj "
                         f"{tuple(gate_up_proj.shape)}, got {tuple(down_proj.shape)}")
    _checks.same_dtype(("hidden_states", "gate_up_proj", "down_proj"), (hidden_states, gate_up_proj, down_proj))
    _checks.same_device(("hidden_states", "top_k_index", "top_k_weights", "gate_up_proj", "down_proj"),
                        (hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj))
    if values:  # under torch.compile the op checks them when it runs
        check_expert_ids(top_k_index, e)


def moe_experts(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up_proj: torch.Tensor, down_proj: torch.Tensor, *, activation: str = "silu",
                backend: Optional[str] = None) -> torch.Tensor:
    """Mixture-of-experts gated-linear-unit experts with Hugging Face semantics.

    ``out[t] = sum_j top_k_weights[t, j] * down_proj[e] @ (act(gate) * up)`` with
    ``gate, up = (gate_up_proj[e] @ hidden_states[t]).chunk(2)`` and ``e = top_k_index[t, j]``;
    ``act`` is SiLU (SwiGLU experts) unless ``activation`` says otherwise.

    Args:
        hidden_states: ``[T, H]`` float32 / bfloat16 / float16 (float64 on the reference).
        top_k_index: integer ``[T, k]``, expert ids in ``[0, E)``.
        top_k_weights: ``[T, k]`` routing weights, any float dtype.
        gate_up_proj: ``[E, 2I, H]``, gate rows first; hidden_states' dtype.
        down_proj: ``[E, H, I]``; hidden_states' dtype.
        activation: ``"silu"``, ``"gelu"`` (exact) or ``"gelu_tanh"`` (tanh approximation), as for
            :func:`twinkle_kernels.swiglu`.
        backend: ``None``/"auto", "reference", "cpu", "triton" or "npu".

    Returns ``[T, H]`` in hidden_states' dtype; differentiable in hidden_states,
    top_k_weights, gate_up_proj and down_proj. Deterministic.

    Example::

        out = moe_experts(x, idx, w, experts.gate_up_proj, experts.down_proj)
    """
    compiling = torch.compiler.is_compiling()
    _check_moe(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, values=not compiling)
    _activations.check(activation)
    if compiling:
        return _library.moe_experts(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj,
                                    backend, activation)
    return _MOE(hidden_states.device, backend, hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj,
                activation)


def _moe_grouped(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, gmm_backend: str,
                 activation: str = "silu"):
    plan = make_routing_plan(top_k_index, gate_up_proj.shape[0])
    gmm = _GMM.impls[gmm_backend].fn
    xp = permute_tokens(hidden_states, plan)
    h = gmm(xp, gate_up_proj.transpose(1, 2), plan.offsets)
    gate, up = h.chunk(2, dim=-1)
    a = _activations.apply(gate, activation) * up
    yp = gmm(a, down_proj.transpose(1, 2), plan.offsets)
    return unpermute_tokens(yp, top_k_weights, plan)


# -- registrations (fast backends import lazily: importing the package never imports triton
#    or the extension) ---------------------------------------------------------------------
_GMM.register("reference")(grouped_matmul_reference)
_MOE.register("reference")(moe_experts_reference)


_cpu_reason = by_first(cpu_reason)
_triton_reason = by_first(triton_reason)


@_GMM.register("cpu", verify=_cpu_reason)
def _gmm_cpu(x, w, offsets):
    from . import _cpu
    return _cpu.grouped_matmul(x, w, offsets)


@_GMM.register("triton", verify=_triton_reason)
def _gmm_triton(x, w, offsets):
    from . import _triton
    return _triton.grouped_matmul(x, w, offsets)


@_MOE.register("cpu", verify=_cpu_reason)
def _moe_cpu(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation="silu"):
    return _moe_grouped(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, "cpu", activation)


@_MOE.register("triton", verify=_triton_reason)
def _moe_triton(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation="silu"):
    return _moe_grouped(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, "triton", activation)


# The backward kernels for the grouped-matmul custom op under torch.compile (_library); it saves
# only its inputs. npu (a backward of its own, untested off an NPU) and reference rerun the forward.
for _b in ("cpu", "triton"):
    _GMM.register_stages(_b, None, _dispatch.lazy(f"{__name__}._{_b}", "grouped_matmul_backward"))
del _b

# npu_grouped_matmul with twinkle's backward (twinkle_kernels.moe._npu imports torch_npu on its first call)
_GMM.register("npu", verify=npu_moe.gmm_reason)(npu_moe.grouped_matmul)
_MOE.register("npu", verify=npu_moe.moe_reason)(npu_moe.moe_experts)
