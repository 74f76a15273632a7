"""Ascend NPU backend (torch_npu / triton-ascend).

Device detection is explicit: torch_npu is imported only when asked for, and the
backend is available only when ``torch.npu.is_available()`` says so afterwards. CPU
and CUDA installs never import torch_npu. The fused NPU ops are registered by the
NPU issue; until then every op reports the backend as unavailable.
"""
from __future__ import annotations

from typing import Optional


def unavailable_reason() -> Optional[str]:
    try:
        import importlib.util

        if importlib.util.find_spec("torch_npu") is None:
            return "torch_npu is not installed"
        import torch
        import torch_npu  # noqa: F401

        if not torch.npu.is_available():
            return "torch_npu is installed but no NPU is available"
    except Exception as e:
        return f"torch_npu failed to import ({type(e).__name__}: {e})"
    return None
