"""Which backends this process can use: the availability probes, cached per process.

A leaf: the op registry (:mod:`._dispatch`), the verifiers and ``python -m twinkle_kernels`` ask
here; nothing here imports an op or a backend's implementation. A probe imports the backend's
package on first ask (triton, the C++ extension, torch_npu), never at import.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Dict, Optional

BACKENDS = ("reference", "cpu", "triton", "npu")

STATUS_CACHE: Dict[str, Optional[str]] = {}
"""backend -> :func:`backend_status`'s answer, once probed (the dispatcher's hot path reads it directly;
:func:`twinkle_kernels.reset` clears it)."""


def backend_status(backend: str) -> Optional[str]:
    """None if ``backend`` is usable in this process, else the reason it is not."""
    if backend not in STATUS_CACHE:
        STATUS_CACHE[backend] = _probe(backend)
    return STATUS_CACHE[backend]


def _probe(backend: str) -> Optional[str]:
    if backend == "reference":
        return None
    if backend == "cpu":
        from . import _cpu_ext

        return _cpu_ext.unavailable_reason()
    if backend == "triton":
        try:
            import triton  # noqa: F401
        except Exception as e:  # ImportError, or a broken install
            return f"triton is not importable ({type(e).__name__}: {e})"
        return None
    if backend == "npu":
        return npu_unavailable_reason()
    return f"unknown backend {backend!r}"


def npu_unavailable_reason() -> Optional[str]:
    """None when an NPU is usable in this process, else why not. Imports torch_npu (only here,
    only when asked): CPU and CUDA installs never do."""
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


def triton_interpret() -> bool:
    """Triton runs CPU tensors only in its interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
