""":func:`twinkle_kernels.sum_of_squares` on the C++ CPU backend (``csrc/reduce/sum_squares.cpp``)."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .. import _cpu_ext


def missing_reason() -> Optional[str]:
    """Why the loaded C++ build cannot serve the op (one built before it existed), or None."""
    if not hasattr(_cpu_ext.ops(), "sum_squares"):
        return "the loaded C++ extension predates sum_squares: rebuild it"
    return None


def sum_of_squares(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    out = torch.empty((), dtype=torch.float64)
    _cpu_ext.ops().sum_squares([t.detach() for t in tensors], out)
    return out
