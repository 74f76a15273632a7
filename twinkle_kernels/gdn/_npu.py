"""NPU Gated DeltaNet (``chunk_gated_delta_rule``, ``fused_recurrent_gated_delta_rule``) via triton-ascend.

Two sources, tried in this order at call time (never at import):

1. flash-linear-attention's own kernels (``fla.ops.gated_delta_rule``) when ``fla`` is importable
   and the installed ``triton`` is triton-ascend: fla's Triton kernels are what its Ascend
   support compiles through triton-ascend;
2. twinkle's own Triton kernels (:mod:`twinkle_kernels.gdn._triton`) on NPU tensors, when the
   installed ``triton`` package is triton-ascend.

Otherwise the verifier says why and the registry falls back to the reference. The patch
toggle ``TWINKLE_NPU_FLA=0`` (read by ``twinkle_patches.apply``) keeps the torch GDN path of
the Hugging Face model instead.

Detection of triton-ascend: the ``triton-ascend`` distribution is installed (it provides the
``triton`` import name). Nothing here has run on Ascend hardware.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from typing import Optional

from .._verifiers import FORWARD_ONLY, needs_grad
from ..npu import ops as _ops

_TRITON_ASCEND_DISTS = ("triton-ascend", "triton_ascend")


def triton_ascend_reason() -> Optional[str]:
    """None when the installed ``triton`` is triton-ascend, else why not."""
    for dist in _TRITON_ASCEND_DISTS:
        try:
            importlib.metadata.distribution(dist)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    else:
        return "triton-ascend is not installed (the npu GDN kernels are Triton kernels compiled by it)"
    if importlib.util.find_spec("triton") is None:
        return "triton-ascend is installed but `import triton` is not available"
    return None


def fla_available() -> bool:
    """Whether flash-linear-attention's gated delta rule ops are importable."""
    if importlib.util.find_spec("fla") is None:
        return False
    try:
        importlib.import_module("fla.ops.gated_delta_rule")
    except Exception:
        return False
    return True


def _fla_call(name, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
              cu_seqlens):
    mod = importlib.import_module("fla.ops.gated_delta_rule")
    return getattr(mod, name)(q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                              output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


def source() -> str:
    """'fla' or 'twinkle': whose Triton kernels the npu backend runs (call only when available)."""
    return "fla" if fla_available() else "twinkle"


def chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                           cu_seqlens, chunk_size):
    if source() == "fla":
        return _fla_call("chunk_gated_delta_rule", q, k, v, g, beta, scale, initial_state, output_final_state,
                         use_qk_l2norm_in_kernel, cu_seqlens)
    from . import _triton
    return _triton.chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                                          use_qk_l2norm_in_kernel, cu_seqlens, chunk_size)


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                                     use_qk_l2norm_in_kernel, cu_seqlens, chunk_size=None):
    if source() == "fla":
        return _fla_call("fused_recurrent_gated_delta_rule", q, k, v, g, beta, scale, initial_state,
                         output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)
    from . import _triton
    return _triton.fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                                                    use_qk_l2norm_in_kernel, cu_seqlens)


def chunk_reason(q, *rest) -> Optional[str]:
    return _ops.tensor_reason(q) or triton_ascend_reason()


def recurrent_reason(q, k, v, g, beta, scale, initial_state, *rest) -> Optional[str]:
    if needs_grad(q, k, v, g, beta, initial_state) and not fla_available():
        return FORWARD_ONLY  # twinkle's fused recurrent kernel is forward only
    return chunk_reason(q)
