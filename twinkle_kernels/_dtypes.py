"""The dtypes every op shares: what the fast backends serve, and what the references compute in."""
from __future__ import annotations

import torch

FAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Input dtypes the cpu, triton and npu backends serve; others (float64) run on the reference."""


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The references' math dtype: float64 stays float64, everything else runs in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32
