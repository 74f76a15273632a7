""":func:`twinkle_kernels.wgrad_accum` on the C++ CPU backend (``csrc/linear/wgrad_accum.cpp``)."""
from __future__ import annotations

from .. import _cpu_ext


def wgrad_accum(x, dy, main_grad) -> None:
    _cpu_ext.op("wgrad_accum")(x, dy, main_grad)
