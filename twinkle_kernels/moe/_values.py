"""The checks of the MoE ops that read tensor values (a host copy; a device sync on GPUs).

Eager calls run them with the other argument checks; under torch.compile they run inside the
custom ops (:mod:`twinkle_kernels.moe._library`), where reading values does not break the graph.
"""
from __future__ import annotations

import torch


def check_offset_values(offsets: torch.Tensor, num_rows: int) -> None:
    """offsets: int32 ``[E]`` cumulative end rows; non-decreasing, from >= 0, ending at ``num_rows``."""
    # One small host copy: the fast paths need the group bounds anyway.
    ends = offsets.tolist()
    prev = 0
    for e, end in enumerate(ends):
        if end < prev:
            raise ValueError(f"offsets must be non-decreasing and start at >= 0; offsets[{e}] = {end} "
                             f"after {prev}")
        prev = end
    if prev != num_rows:
        raise ValueError(f"offsets must end at M = x.shape[0] = {num_rows}, got offsets[-1] = {prev}")


def check_expert_ids(top_k_index: torch.Tensor, num_experts: int) -> None:
    """top_k_index: integer ``[T, k]``; every value an expert id in ``[0, num_experts)``."""
    if top_k_index.numel():
        lo, hi = int(top_k_index.min()), int(top_k_index.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"top_k_index values must be expert ids in [0, {num_experts}) "
                             f"(E = gate_up_proj.shape[0]), got values in [{lo}, {hi}]")
