"""RMSNorm family: plain, zero-centred (``offset=1.0``) and gated.

Backends: ``reference`` (:mod:`.reference`), ``cpu`` (C++ in ``csrc/norm``, :mod:`._cpu`),
``triton`` (:mod:`._triton`) and ``npu`` (:mod:`twinkle_kernels.npu.ops`).
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import _checks, _dispatch
from .._verifiers import by_first, cpu_reason, npu_reason, triton_reason
from ..npu import ops as npu_ops
from . import _library
from .reference import gated_rms_norm_reference, rms_norm_reference

__all__ = ["rms_norm", "gated_rms_norm", "rms_norm_reference", "gated_rms_norm_reference"]

_RMS = _dispatch.op("rms_norm")
_GATED = _dispatch.op("gated_rms_norm")


# -- reference --------------------------------------------------------------------------------
_RMS.register("reference")(lambda x, weight, eps, offset: rms_norm_reference(x, weight, eps, offset))
_GATED.register("reference")(lambda x, gate, weight, eps: gated_rms_norm_reference(x, gate, weight, eps))


def _check_common(x, weight, eps):
    _checks.tensor("x", x, ndim_min=1)
    _checks.tensor("weight", weight)
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must have shape [{x.shape[-1]}] (the last dim of x), got {tuple(weight.shape)}")
    return _checks.positive_float("eps", eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, offset: float = 0.0,
             backend: Optional[str] = None) -> torch.Tensor:
    """Root-mean-square normalisation over the last dim.

    ``y = x * rsqrt(mean(x**2, -1) + eps) * (offset + weight)``; the statistics are
    computed in fp32 and the result has ``x.dtype``.

    Args:
        x: ``[..., N]``, float32 / bfloat16 / float16 (float64 runs on the reference).
        weight: ``[N]``, any float dtype (fp32 master weights with bf16 activations are fine).
        eps: added to the mean square.
        offset: 0.0 for Llama / Qwen2 / Qwen3; 1.0 for the zero-centred norm of
            Qwen3.5 / Qwen3-Next (``(1 + weight)``, weight initialised at 0).
        backend: ``None``/"auto", "reference", "cpu", "triton" or "npu".

    Returns ``[..., N]`` in ``x.dtype``; differentiable in ``x`` and ``weight``.

    Example::

        y = rms_norm(torch.randn(4, 128, 4096), torch.ones(4096), 1e-6)
    """
    eps = _check_common(x, weight, eps)
    offset = _checks.finite_float("offset", offset)
    _checks.same_device(("x", "weight"), (x, weight))
    if torch.compiler.is_compiling():  # one opaque op in the graph; the dispatch runs inside it
        return _library.rms_norm(x, weight, eps, offset, backend)[0]
    return _RMS(x.device, backend, x, weight, eps, offset)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
                   backend: Optional[str] = None) -> torch.Tensor:
    """``rms_norm(x, weight, eps) * silu(gate)`` — Qwen3.5 / Qwen3-Next ``RMSNormGated``.

    Args:
        x: ``[..., N]`` (float32 / bfloat16 / float16).
        gate: like ``x``, same shape and dtype.
        weight: ``[N]``, any float dtype.

    Returns ``[..., N]`` in ``x.dtype``; differentiable in ``x``, ``gate`` and ``weight``.
    """
    eps = _check_common(x, weight, eps)
    _checks.tensor("gate", gate)
    _checks.same_shape(("x", "gate"), (x, gate))
    _checks.same_dtype(("x", "gate"), (x, gate))
    _checks.same_device(("x", "gate", "weight"), (x, gate, weight))
    if torch.compiler.is_compiling():
        return _library.gated_rms_norm(x, gate, weight, eps, backend)[0]
    return _GATED(x.device, backend, x, gate, weight, eps)


# -- fast backends (imported lazily: importing the package never imports triton, the extension
#    or torch_npu). Every verifier judges the call by x.
@_RMS.register("cpu", verify=by_first(cpu_reason))
def _rms_cpu(x, weight, eps, offset):
    from . import _cpu
    return _cpu.rms_norm(x, weight, eps, offset)


@_GATED.register("cpu", verify=by_first(cpu_reason))
def _gated_cpu(x, gate, weight, eps):
    from . import _cpu
    return _cpu.gated_rms_norm(x, gate, weight, eps)


@_RMS.register("triton", verify=by_first(triton_reason))
def _rms_triton(x, weight, eps, offset):
    from . import _triton
    return _triton.rms_norm(x, weight, eps, offset)


@_GATED.register("triton", verify=by_first(triton_reason))
def _gated_triton(x, gate, weight, eps):
    from . import _triton
    return _triton.gated_rms_norm(x, gate, weight, eps)


# The forward with its statistics (rstd fp32 [M]) and the backward kernel that takes them, for the
# custom ops under torch.compile (_library); reference and npu have no backward kernel of their own.
for _b in ("cpu", "triton"):
    _m = f"{__name__}._{_b}"
    _RMS.register_stages(_b, _dispatch.lazy(_m, "rms_norm_forward"), _dispatch.lazy(_m, "rms_norm_backward"))
    _GATED.register_stages(_b, _dispatch.lazy(_m, "gated_rms_norm_forward"),
                           _dispatch.lazy(_m, "gated_rms_norm_backward"))
del _b, _m

# torch_npu's fused operators (twinkle_kernels.npu.ops import torch_npu on their first call)
_RMS.register("npu", verify=by_first(npu_reason))(npu_ops.rms_norm)
_GATED.register("npu", verify=by_first(npu_reason))(npu_ops.gated_rms_norm)
