"""Packed sequences for the facade: Hugging Face ``position_ids`` that restart at 0 for every
sample in a row (transformers' ``DataCollatorWithFlattening`` convention) become megatron's THD
``PackedSeqParams``.

A micro-batch of ``b`` rows of ``s`` tokens is flattened into one row of ``b * s`` tokens; a new
sequence starts at every row start and wherever the position is not the previous one plus 1
(normally: where it is 0). ``cu_seqlens`` (int32 [N + 1]) marks the boundaries; attention, RoPE
positions, the Gated DeltaNet state and its causal conv all restart there.
"""
from __future__ import annotations

from typing import Optional

import torch


def is_packed(position_ids: Optional[torch.Tensor]) -> bool:
    """Whether ``position_ids`` [B, S] differ from ``0..S-1`` in some row."""
    if position_ids is None:
        return False
    b, s = position_ids.shape
    return not torch.equal(position_ids.long().cpu(), torch.arange(s).expand(b, -1))


def cu_seqlens(position_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Boundaries (int32 [N + 1]) of the sequences in ``position_ids`` [B, S] flattened row by row.

    Tokens where ``attention_mask`` is 0 (right padding) extend the sequence before them rather
    than starting one each. Raises ValueError when a row starts at a position other than 0 or a
    position is negative."""
    pos = position_ids.long().cpu().clone()
    if pos.dim() != 2:
        raise ValueError(f"position_ids must be [B, S], got shape {tuple(pos.shape)}")
    if (pos < 0).any():
        raise ValueError("position_ids must be >= 0")
    b, s = pos.shape
    if attention_mask is not None:
        # Right padding (the facade checks it) continues the row's last sequence: positions
        # last + 1, last + 2, ... (or 0, 1, ... in an all-padding row).
        real = attention_mask.bool().cpu()
        n = real.sum(1, keepdim=True)
        last = torch.where(n > 0, pos.gather(1, (n - 1).clamp(min=0)), torch.full_like(n, -1))
        pos = torch.where(real, pos, last + torch.arange(s)[None, :] - n + 1)
    if pos.shape[1] and (pos[:, 0] != 0).any():
        raise ValueError("position_ids must start at 0 in every row (packed samples restart at 0)")
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    flat = torch.nonzero(starts.reshape(-1)).reshape(-1)
    return torch.cat([flat, torch.tensor([b * s])]).to(torch.int32)


def segments(cu: torch.Tensor):
    """``[(start, end), ...]`` of the non-empty sequences in boundaries ``cu`` (int, [N + 1])."""
    bounds = cu.tolist()
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def thd_bounds(params):
    """``(cu_q, cu_kv)`` of a THD ``PackedSeqParams``: the padded boundaries where given (megatron
    lays tokens out by them), else the plain ones."""
    pick = lambda padded, plain: padded if padded is not None else plain  # noqa: E731
    return (pick(params.cu_seqlens_q_padded, params.cu_seqlens_q),
            pick(params.cu_seqlens_kv_padded, params.cu_seqlens_kv))


def packed_seq_params(cu: torch.Tensor, device) -> "object":
    """megatron's ``PackedSeqParams`` (THD, self-attention) for boundaries ``cu``."""
    from megatron.core.packed_seq_params import PackedSeqParams
    cu = cu.to(device=device, dtype=torch.int32)
    longest = int((cu[1:] - cu[:-1]).max()) if len(cu) > 1 else 0
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


def extend(cu: torch.Tensor, total: int) -> torch.Tensor:
    """``cu`` with one more sequence covering tokens ``cu[-1]:total`` (padding), if any."""
    if total == int(cu[-1]):
        return cu
    return torch.cat([cu, torch.tensor([total], dtype=cu.dtype)])
