"""A packing-aware attention implementation for transformers' ``AttentionInterface``.

With packed (padding-free) batches — ``position_ids`` restarting per sample, or the flash-style
``cu_seq_lens_q/k`` + ``max_length_q/k`` that ``DataCollatorWithFlattening`` makes — transformers'
``sdpa`` and ``eager`` paths attend across samples whenever a cache object exists (the default
``use_cache=True``): their mask only sees packing when ``past_key_values is None``. This
implementation builds the block-diagonal causal mask from the packing kwargs itself and then runs
transformers' own ``sdpa_attention_forward``; unpacked calls go straight to it.

It is registered under its own name (:data:`NAME`) and selected per model
(``model.set_attn_implementation``); the global ``sdpa`` entry is never replaced.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from twinkle_kernels._patching import Patcher

NAME = "twinkle_packed"


def _segment_ids(query: torch.Tensor, key: torch.Tensor, kwargs) -> Optional[torch.Tensor]:
    """[B, S] sample index of each token, or None when the batch is not packed."""
    B, S = query.shape[0], query.shape[2]
    if key.shape[2] != S:  # decoding against a cache: packing is a training-time layout
        return None
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        if B != 1 or int(cu[-1]) != S:
            raise ValueError(f"cu_seq_lens_q needs a packed batch of size 1 whose length is cu_seq_lens_q[-1]; "
                             f"got batch {B}, length {S}, cu_seq_lens_q[-1]={int(cu[-1])}")
        t = torch.arange(S, device=query.device)
        return torch.searchsorted(cu.to(device=query.device, dtype=torch.long)[1:], t, right=True)[None]
    pos = kwargs.get("position_ids")
    if pos is None or pos.shape[-1] != S:
        return None
    pos = pos.to(query.device).expand(B, S) if pos.dim() == 2 else None
    if pos is None:
        return None
    # a sample starts wherever the position does not continue the previous one (as transformers'
    # find_packed_sequence_indices, which its masks only apply without a cache)
    seg = (torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1).cumsum(-1)
    return seg if bool((seg[:, -1] != 0).any()) else None


def packed_sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                  sliding_window=None, **kwargs):
    """``AttentionInterface`` function: q [B, H, S, D], k/v [B, Hkv, S, D] -> ([B, S, H, D], None).

    A packed batch gets a block-diagonal causal mask (and the sliding window, when the layer has one)
    combined with the mask transformers built; everything else is ``sdpa_attention_forward``.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    seg = _segment_ids(query, key, kwargs)
    if seg is not None:
        S = query.shape[2]
        i = torch.arange(S, device=query.device)
        allowed = (seg[:, :, None] == seg[:, None, :]) & (i[:, None] >= i[None, :])
        if sliding_window:
            allowed &= (i[:, None] - i[None, :]) < sliding_window
        allowed = allowed[:, None]  # [B, 1, S, S]
        if attention_mask is not None:
            m = attention_mask[..., :S]
            allowed = allowed & (m if m.dtype == torch.bool else m == 0)
            # a row masked out entirely (padding inside a packed batch) would give NaN: let it see itself
            allowed = allowed | (~allowed.any(-1, keepdim=True) & torch.eye(S, dtype=torch.bool, device=query.device))
        attention_mask = allowed
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def register_named(name: str, forward) -> Optional[Callable[[], None]]:
    """Add ``forward`` to transformers' attention interface under ``name``, with transformers'
    ``sdpa_mask`` (boolean, True = attend, or None for plain causal) as its mask. Returns the undo,
    or None when ``name`` was registered already. The global ``sdpa`` entry is never touched."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    if name in AttentionInterface._global_mapping:
        return None
    swaps = Patcher()
    swaps.setitem(AttentionInterface._global_mapping, name, forward)
    swaps.setitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, name, sdpa_mask)
    return swaps.undo


def register() -> Optional[Callable[[], None]]:
    """Adds :data:`NAME` to transformers' attention and mask interfaces; returns the undo (or None
    if it was there already)."""
    return register_named(NAME, packed_sdpa_attention_forward)
