"""The float64 reference of :func:`twinkle_kernels.sum_of_squares`."""
from __future__ import annotations

from typing import Sequence

import torch

_SLICE = 1 << 20


def sum_of_squares_reference(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``sum_t sum_i float64(t[i])**2`` over ``tensors``: a 0-dim float64 tensor on their device
    (the CPU for an empty list). Each tensor is widened to float64 a slice at a time (2**20
    elements: a model's largest gradient is never copied whole) and dotted with itself."""
    device = tensors[0].device if len(tensors) else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    for t in tensors:
        for part in t.detach().reshape(-1).split(_SLICE):
            part = part.to(torch.float64)
            total += torch.dot(part, part)
    return total
