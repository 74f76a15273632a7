"""megatron's local core attention extended to packed sequences (THD, ``PackedSeqParams``).

megatron-core's local ``DotProductAttention`` refuses ``packed_seq_params`` (only
TransformerEngine's attention takes the THD format). :class:`PackedDotProductAttention` runs the
local attention once per packed sequence, so each sample attends causally to itself only and the
arithmetic is exactly the local attention's. Memory is O(max_seqlen**2) per head, fine on CPU.
"""
from __future__ import annotations

import functools

import torch

from .packing import segments, thd_bounds


@functools.lru_cache(maxsize=None)
def _packed_class() -> type:
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    class PackedDotProductAttention(DotProductAttention):
        """``DotProductAttention`` that also takes THD inputs: query ``[T, np, hn]``, key / value
        ``[T, ng, hn]`` with ``packed_seq_params.cu_seqlens_q`` (int32 [N + 1]) -> ``[T, np * hn]``.
        Without ``packed_seq_params`` it is megatron's local attention unchanged."""

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if packed_seq_params is None:
                return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                       attention_bias=attention_bias)
            if packed_seq_params.qkv_format != "thd":
                raise NotImplementedError(f"packed_seq_params.qkv_format={packed_seq_params.qkv_format!r} "
                                          "is not supported (thd)")
            if attention_bias is not None:
                raise NotImplementedError("attention_bias with packed sequences is not supported")
            cu_q, cu_kv = thd_bounds(packed_seq_params)
            if cu_kv is not None and not torch.equal(cu_q.cpu(), cu_kv.cpu()):
                raise NotImplementedError("packed self-attention needs cu_seqlens_q == cu_seqlens_kv")
            if int(cu_q[-1]) != query.shape[0]:
                raise ValueError(f"packed_seq_params.cu_seqlens_q ends at {int(cu_q[-1])}, the packed "
                                 f"query has {query.shape[0]} tokens")
            out = query.new_empty(query.shape[0], query.shape[1] * query.shape[2])
            for a, b in segments(cu_q):
                # [n, 1, heads, dim]: one sequence as a batch of one, causal within itself
                ctx = super().forward(query[a:b].unsqueeze(1), key[a:b].unsqueeze(1), value[a:b].unsqueeze(1),
                                      None, attn_mask_type=AttnMaskType.causal)
                out[a:b] = ctx.reshape(b - a, -1)
            return out

    return PackedDotProductAttention


def __getattr__(name):
    # A class built lazily: megatron-core is imported only when the attention is used.
    if name == "PackedDotProductAttention":
        return _packed_class()
    raise AttributeError(name)
