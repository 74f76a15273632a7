"""Ascend NPU backend (torch_npu / triton-ascend).

Device detection is explicit: torch_npu is imported only when the ``npu`` backend is
first asked about, and the backend is available only when ``torch.npu.is_available()``
says so afterwards. CPU and CUDA installs never import torch_npu: importing
``twinkle_kernels`` only registers the NPU implementations in the op registry (no
import, no patching); each one imports torch_npu on its first call.

Modules: :mod:`.ops` (RMSNorm family, RoPE, SwiGLU over torch_npu's fused operators),
:mod:`.moe` (``grouped_matmul`` / ``moe_experts`` over ``npu_grouped_matmul`` with twinkle's backward),
:mod:`.gdn` (Gated DeltaNet through triton-ascend). The framework glue lives with its framework:
``twinkle_patches.npu_attention`` (the named ``"twinkle_npu_fa"`` implementation for transformers)
and ``twinkle_megatron.mindspeed`` (MindSpeed's megatron adaptor, applied by
``twinkle_megatron.initialize`` on NPU).

Nothing here has run on Ascend hardware in this project's CI; see the README's
"Ascend NPU" support matrix for what has been verified.
"""
from __future__ import annotations

import importlib.util
from typing import Optional


def unavailable_reason() -> Optional[str]:
    """None when an NPU is usable in this process, else why not."""
    if importlib.util.find_spec("torch_npu") is None:
        return "torch_npu is not installed"
    try:
        import torch
        import torch_npu  # noqa: F401
    except Exception as e:
        return f"torch_npu failed to import ({type(e).__name__}: {e})"
    if not (hasattr(torch, "npu") and torch.npu.is_available()):
        return "torch_npu is installed but no NPU is available"
    return None


def register() -> None:
    """Add the NPU implementations to the op registry (idempotent)."""
    from . import ops

    ops.register_all()
