"""Ascend NPU backend (torch_npu / triton-ascend).

Device detection is explicit: torch_npu is imported only when the ``npu`` backend is
first asked about, and the backend is available only when ``torch.npu.is_available()``
says so afterwards (the probe lives with the others in :mod:`twinkle_kernels._backends`). CPU and
CUDA installs never import torch_npu: each op package registers its NPU implementation in the op
registry like its cpu and triton ones (no import, no patching); each one imports torch_npu on its
first call.

Here: :mod:`.ops` (RMSNorm family, RoPE, SwiGLU over torch_npu's fused operators, shared by those
op packages). The NPU backends that build on an op package's own code live in that package, beside
its ``_cpu`` and ``_triton``: ``twinkle_kernels.moe._npu`` (``grouped_matmul`` / ``moe_experts``
over ``npu_grouped_matmul`` with twinkle's backward) and ``twinkle_kernels.gdn._npu`` (Gated
DeltaNet through triton-ascend). The framework glue lives with its framework:
``twinkle_patches.npu_attention`` (the named ``"twinkle_npu_fa"`` implementation for transformers)
and ``twinkle_megatron.parallel.mindspeed`` (MindSpeed's megatron adaptor, applied by
``twinkle_megatron.initialize`` on NPU).

Nothing here has run on Ascend hardware in this project's CI; see the support matrix in
``docs/npu.md`` for what has been verified.
"""
from __future__ import annotations

from .._backends import npu_unavailable_reason as unavailable_reason

__all__ = ["unavailable_reason"]
