"""A linear layer's weight gradient added straight into an fp32 accumulation buffer: megatron's
"gradient accumulation fusion" (``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32``, which
comes with apex on GPUs), for the CPU.

Backends: ``reference`` (:mod:`.reference`: the product, then the add) and ``cpu`` (C++ in
``csrc/linear``, :mod:`._cpu`). The cpu backend never writes the whole ``[N, K]`` product to
memory: it computes it in row tiles and adds each into ``main_grad`` while it is in cache. The
sums are the unfused path's (the product rounded to the inputs' dtype, as autograd's weight
gradient is, then added in fp32).
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import _checks, _dispatch
from .._verifiers import by_first, cpu_reason
from .reference import wgrad_accum_reference

__all__ = ["wgrad_accum", "wgrad_accum_reference"]

_OP = _dispatch.op("wgrad_accum")
_OP.register("reference")(wgrad_accum_reference)

_IN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def wgrad_accum(x: torch.Tensor, dy: torch.Tensor, main_grad: torch.Tensor, *, accumulate: bool = True,
                backend: Optional[str] = None) -> None:
    """``main_grad += dy^T @ x`` in place: the weight gradient of ``y = x @ w^T`` accumulated into
    ``main_grad``; with ``accumulate=False``, ``main_grad = dy^T @ x`` (the same values as adding
    into zeros, without reading or zeroing ``main_grad`` first).

    Args:
        x: ``[M, K]`` float32 / bfloat16 / float16, the layer's input rows.
        dy: ``[M, N]`` in x's dtype, the gradient of the layer's output.
        main_grad: ``[N, K]`` contiguous float32, updated in place (megatron's ``weight.main_grad``).
        accumulate: add into ``main_grad`` (True) or overwrite it (False: zeros when M is 0).
        backend: ``None``/"auto", "reference" or "cpu".

    Every argument is checked before anything is written. Not differentiable (a gradient's own
    accumulation).

    Example::

        wgrad_accum(x.view(-1, x.shape[-1]), dy.view(-1, dy.shape[-1]), weight.main_grad)
    """
    _checks.tensor("x", x)
    _checks.tensor("dy", dy)
    _checks.tensor("main_grad", main_grad)
    if x.dim() != 2 or dy.dim() != 2 or main_grad.dim() != 2:
        raise ValueError(f"x, dy and main_grad must be 2-D ([M, K], [M, N], [N, K]), got {tuple(x.shape)}, "
                         f"{tuple(dy.shape)} and {tuple(main_grad.shape)}")
    if x.dtype not in _IN_DTYPES:
        raise TypeError(f"x has dtype {x.dtype}; expected float32, bfloat16 or float16")
    _checks.same_dtype(("x", "dy"), (x, dy))
    if dy.shape[0] != x.shape[0]:
        raise ValueError(f"dy has {dy.shape[0]} rows but x has {x.shape[0]}; they must match")
    if tuple(main_grad.shape) != (dy.shape[1], x.shape[1]):
        raise ValueError(f"main_grad has shape {tuple(main_grad.shape)}; expected [dy.shape[1], x.shape[1]] = "
                         f"{[dy.shape[1], x.shape[1]]}")
    if main_grad.dtype != torch.float32:
        raise TypeError(f"main_grad must be float32 (the accumulation buffer), got {main_grad.dtype}")
    if not main_grad.is_contiguous():
        raise ValueError("main_grad must be contiguous (it is updated in place)")
    _checks.same_device(("x", "dy", "main_grad"), (x, dy, main_grad))
    if not isinstance(accumulate, bool):
        raise TypeError(f"accumulate must be a bool, got {type(accumulate).__name__}")
    _OP(x.device, backend, x, dy, main_grad, accumulate)


@_OP.register("cpu", verify=by_first(cpu_reason))
def _wgrad_cpu(x, dy, main_grad, accumulate=True):
    from . import _cpu
    _cpu.wgrad_accum(x, dy, main_grad, accumulate)
