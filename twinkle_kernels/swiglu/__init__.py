"""Gated linear units: ``act(gate) * up``, as two tensors or Megatron's packed layout.

``act`` is SiLU by default (SwiGLU); ``activation="gelu"`` / ``"gelu_tanh"`` give GeGLU with exact
GELU or its tanh approximation (the names: :mod:`twinkle_kernels._activations`). Every backend
serves all three except ``npu``, whose fused ``npu_swiglu`` is SiLU only: a GELU call on NPU
tensors is refused by its verifier, so the registry says why once in the log and runs the
reference there (pure torch).
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import _activations, _checks, _dispatch
from .._verifiers import by_first, cpu_reason, triton_reason
from ..npu import ops as npu_ops
from . import _library
from .reference import swiglu_packed_reference, swiglu_reference

__all__ = ["swiglu", "swiglu_packed", "swiglu_reference", "swiglu_packed_reference"]

_SWIGLU = _dispatch.op("swiglu")
_PACKED = _dispatch.op("swiglu_packed")

_SWIGLU.register("reference")(swiglu_reference)
_PACKED.register("reference")(swiglu_packed_reference)


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, activation: str = "silu",
           backend: Optional[str] = None) -> torch.Tensor:
    """``act(gate) * up``, ``act`` = ``silu`` unless ``activation`` says otherwise.

    Args:
        gate: ``[..., I]`` (float32 / bfloat16 / float16).
        up: like ``gate``, same shape and dtype.
        activation: ``"silu"`` (SwiGLU), ``"gelu"`` (exact GELU, GeGLU) or ``"gelu_tanh"``
            (GELU's tanh approximation, transformers' ``gelu_pytorch_tanh`` / ``gelu_new``).

    Returns ``[..., I]`` in that dtype (math in fp32); differentiable in both.

    Example::

        h = swiglu(x @ w_gate.T, x @ w_up.T)
        h = swiglu(x @ w_gate.T, x @ w_up.T, activation="gelu_tanh")   # Gemma's GeGLU
    """
    _checks.tensor("gate", gate)
    _checks.tensor("up", up)
    _checks.same_shape(("gate", "up"), (gate, up))
    _checks.same_dtype(("gate", "up"), (gate, up))
    _checks.same_device(("gate", "up"), (gate, up))
    _activations.check(activation)
    if torch.compiler.is_compiling():  # one opaque op in the graph; the dispatch runs inside it
        return _library.swiglu(gate, up, backend, activation)
    return _SWIGLU(gate.device, backend, gate, up, activation)


def swiglu_packed(x: torch.Tensor, *, activation: str = "silu", backend: Optional[str] = None) -> torch.Tensor:
    """Megatron's packed layout: ``act(x[..., :n]) * x[..., n:]``, ``n = x.shape[-1] // 2``.

    Args:
        x: ``[..., 2n]`` float32 / bfloat16 / float16.
        activation: as for :func:`swiglu`.

    Returns ``[..., n]`` in x's dtype; differentiable in x.
    """
    _checks.tensor("x", x, ndim_min=1)
    if x.shape[-1] % 2:
        raise ValueError(f"x's last dim must be even (gate and up halves), got {x.shape[-1]}")
    _activations.check(activation)
    if torch.compiler.is_compiling():
        return _library.swiglu_packed(x, backend, activation)
    return _PACKED(x.device, backend, x, activation)


# -- fast backends (imported lazily); every verifier judges the call by its first tensor
_cpu_reason = by_first(cpu_reason)
_triton_reason = by_first(triton_reason)


@_SWIGLU.register("cpu", verify=_cpu_reason)
def _swiglu_cpu(gate, up, activation="silu"):
    from . import _cpu
    return _cpu.swiglu(gate, up, activation)


@_PACKED.register("cpu", verify=_cpu_reason)
def _packed_cpu(x, activation="silu"):
    from . import _cpu
    return _cpu.swiglu_packed(x, activation)


@_SWIGLU.register("triton", verify=_triton_reason)
def _swiglu_triton(gate, up, activation="silu"):
    from . import _triton
    return _triton.swiglu(gate, up, activation)


@_PACKED.register("triton", verify=_triton_reason)
def _packed_triton(x, activation="silu"):
    from . import _triton
    return _triton.swiglu_packed(x, activation)


# The backward kernels for the custom ops under torch.compile (_library): SwiGLU saves only its
# inputs, so the forward runs as is; reference and npu have no backward kernel of their own.
for _b in ("cpu", "triton"):
    _SWIGLU.register_stages(_b, None, _dispatch.lazy(f"{__name__}._{_b}", "swiglu_backward"))
    _PACKED.register_stages(_b, None, _dispatch.lazy(f"{__name__}._{_b}", "swiglu_packed_backward"))
del _b

# torch_npu's fused operator (twinkle_kernels.npu.ops imports torch_npu on its first call); it is
# SiLU only, so its verifier refuses the GELU activations (the reference serves them on the NPU)
_SWIGLU.register("npu", verify=lambda gate, up, activation="silu": npu_ops.swiglu_reason(gate, activation))(
    npu_ops.swiglu)
_PACKED.register("npu", verify=lambda x, activation="silu": npu_ops.swiglu_reason(x, activation))(
    npu_ops.swiglu_packed)
