"""An NPU flash-attention implementation for transformers' ``AttentionInterface``.

Registered under its own name, :data:`NAME` (``"twinkle_npu_fa"``), by an explicit call to
:func:`register_attention` (never at import); the global ``"sdpa"`` entry is never replaced.
Select it per model: ``AutoModelForCausalLM.from_config(cfg, attn_implementation=NAME)`` or
``model.set_attn_implementation(NAME)``.

The kernel is ``torch_npu.npu_fusion_attention`` (torch_npu API reference), called with
``input_layout="BNSD"`` (transformers hands attention q ``[B, H, S, D]``, k/v ``[B, Hkv, S, D]``;
grouped-query attention is native: ``head_num`` is the query head count), ``scale``,
``keep_prob = 1 - dropout`` and a boolean ``atten_mask`` in which **True means masked out**
(the opposite of transformers' boolean masks). Causal attention without a mask uses the
documented compressed form: ``sparse_mode=2`` (``3`` when the query is shorter than the keys,
i.e. decoding against a cache) with a 2048 x 2048 upper-triangular mask. torch_npu registers
the backward of this operator.

Calls it cannot serve — tensors not on an NPU, a sliding window, attention weights requested —
go to transformers' own ``sdpa_attention_forward``, with the reason logged once.
Nothing here has run on Ascend hardware.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

from twinkle_kernels.npu import ops as _ops

from ._attention import register_named

NAME = "twinkle_npu_fa"
_COMPRESSED = 2048  # the documented side of the compressed causal mask for sparse_mode 2 / 3
logger = logging.getLogger("twinkle_kernels")
_LOGGED = set()


def _fallback_reason(query, sliding_window, kwargs) -> Optional[str]:
    if not _ops.on_npu(query):
        return f"query is on {query.device.type}, not an NPU"
    if sliding_window:
        return "sliding-window attention is not wired to npu_fusion_attention here"
    if kwargs.get("output_attentions"):
        return "attention weights were requested; the fused kernel does not return them"
    return None


def _causal_mask(device) -> torch.Tensor:
    return torch.triu(torch.ones(_COMPRESSED, _COMPRESSED, dtype=torch.bool, device=device), diagonal=1)


def npu_fusion_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                                 scaling: Optional[float] = None, sliding_window=None, **kwargs):
    """``AttentionInterface`` function: q ``[B, H, S, D]``, k/v ``[B, Hkv, Skv, D]`` ->
    (``[B, S, H, D]`` in q's dtype, None)."""
    why = _fallback_reason(query, sliding_window, kwargs)
    if why is not None:
        if why not in _LOGGED:
            _LOGGED.add(why)
            logger.info("twinkle_kernels: %s falls back to sdpa: %s", NAME, why)
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    B, H, S, D = query.shape
    Skv = key.shape[2]
    scale = scaling if scaling is not None else D ** -0.5
    sparse_mode = 0
    mask = None
    if attention_mask is not None:
        m = attention_mask[:, :, :, :Skv]
        mask = ~m if m.dtype == torch.bool else (m != 0)  # transformers: True / 0.0 = attend
    elif S > 1 and getattr(module, "is_causal", True):
        mask = _causal_mask(query.device)
        sparse_mode = 2 if S == Skv else 3
    out = _ops.torch_npu_module().npu_fusion_attention(
        query.contiguous(), key.contiguous(), value.contiguous(), H, "BNSD", atten_mask=mask, scale=scale,
        keep_prob=1.0 - (dropout if module.training else 0.0), sparse_mode=sparse_mode)[0]
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> Optional[Callable[[], None]]:
    """Add :data:`NAME` to transformers' attention and mask interfaces (the mask is transformers'
    ``sdpa_mask``: boolean, True = attend, or None for plain causal). Returns the undo, or None
    when it was registered already. Does not import torch_npu."""
    return register_named(NAME, npu_fusion_attention_forward)
