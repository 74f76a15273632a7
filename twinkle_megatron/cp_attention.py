"""Core attention with context parallelism by K/V all-gather (CPU, or anywhere TE is absent).

megatron-core's local ``DotProductAttention`` refuses CP (only TransformerEngine's attention
does ring attention). This module is a drop-in ``core_attention`` for the local layer spec:

- each CP rank holds two of the ``2 * cp`` sequence chunks, ``r`` and ``2*cp - 1 - r`` (megatron's
  load-balanced split, the same one its RoPE uses in ``get_pos_emb_on_this_cp_rank``);
- K and V are all-gathered over the CP group (backward: reduce-scatter of their grads);
- the causal mask compares the global positions of queries and keys.

Memory is O(S) for K/V per rank, scores O(S_local * S): fine for CPU tests and small runs.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule


def cp_positions(local_len: int, cp_rank: int, cp_size: int, device=None) -> Tensor:
    """Global positions [local_len] of this CP rank's tokens under the load-balanced split."""
    chunk = local_len // 2
    first = torch.arange(chunk, device=device) + cp_rank * chunk
    second = torch.arange(chunk, device=device) + (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([first, second])


class ContextParallelAttention(MegatronModule):
    """``core_attention`` for causal self-attention. query [sq, b, np, hn], key/value
    [sq, b, ng, hn] (this rank's tokens) -> context [sq, b, np * hn]."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 **kwargs):
        super().__init__(config=config)
        if (attention_dropout if attention_dropout is not None else config.attention_dropout):
            raise ValueError("ContextParallelAttention does not implement attention dropout")
        self.softmax_scale = softmax_scale if softmax_scale is not None else config.kv_channels ** -0.5
        self.cp_group = parallel_state.get_context_parallel_group()

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                attn_mask_type=None, attention_bias=None, packed_seq_params=None) -> Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("ContextParallelAttention: no packed sequences or attention bias")
        cp_size = self.cp_group.size()
        cp_rank = self.cp_group.rank()
        sq, b, heads, dim = query.shape
        # [sq, b, ng, hn] -> [cp * sq, b, ng, hn], in rank order
        key = gather_from_sequence_parallel_region(key, True, group=self.cp_group)
        value = gather_from_sequence_parallel_region(value, True, group=self.cp_group)
        groups = key.shape[2]
        if heads != groups:
            key = key.repeat_interleave(heads // groups, dim=2)
            value = value.repeat_interleave(heads // groups, dim=2)
        q_pos = cp_positions(sq, cp_rank, cp_size, query.device)
        k_pos = torch.cat([cp_positions(sq, r, cp_size, query.device) for r in range(cp_size)])
        masked = k_pos[None, :] > q_pos[:, None]                         # [sq, sk]
        # [b, np, sq, sk], softmax in fp32
        scores = torch.einsum("qbhd,kbhd->bhqk", query.float(), key.float()) * self.softmax_scale
        scores = scores.masked_fill(masked, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(value.dtype)
        context = torch.einsum("bhqk,kbhd->qbhd", probs, value)
        return context.reshape(sq, b, heads * dim)
