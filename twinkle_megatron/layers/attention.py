"""Core attention modules for megatron-core layer specs.

Local (megatron's arithmetic, used by the facade's local spec):

- :class:`PackedDotProductAttention`: megatron's local ``DotProductAttention`` also taking packed
  sequences (THD, ``PackedSeqParams``), which megatron-core's local attention refuses (only
  TransformerEngine's takes THD). Each sample attends causally to itself only (within the
  config's sliding window, ``window_size``, where the layer has one): on CUDA (fp16 / bf16,
  plain causal softmax) one varlen flash kernel serves the whole pack
  (:func:`packed_attention_impl`); elsewhere the local attention runs once per packed sequence,
  memory O(max_seqlen**2) per head, fine on CPU.
- :class:`LatentCoreAttention` (:func:`latent_core_attention_class`): causal attention with value
  heads narrower than query / key heads, for megatron's multi-latent attention (DeepSeek-V3);
- :class:`ContextParallelAttention`: context parallelism by K/V all-gather (megatron's local
  attention refuses CP; only TransformerEngine's does ring attention). Each CP rank holds two of the
  ``2 * cp`` sequence chunks, ``r`` and ``2*cp - 1 - r`` (megatron's load-balanced split, the one
  its RoPE uses in ``get_pos_emb_on_this_cp_rank``, see :func:`cp_positions`); K and V are
  all-gathered over the CP group (backward: reduce-scatter of their grads); the causal mask (and
  the sliding window) compares global positions. Memory O(S) for K/V per rank, scores O(S_local * S).

Sliding windows: megatron's ``TransformerConfig.window_size = (W - 1, 0)`` (with
``window_attn_skip_freq`` choosing the layers) is transformers' ``sliding_window = W``: a query at
position i sees keys j with ``0 <= i - j < W`` (``masking_utils.sliding_window_overlay``). Every
core attention here applies it (:func:`layer_window`, :func:`sliding_window`); multi-latent
attention refuses one.

On twinkle_kernels:

- :func:`rope_core_attention` subclasses any core attention to rotate q and k with
  ``tk.apply_rotary_pos_emb`` in megatron's ``[S, B, H, D]`` layout (:func:`rotate_sbhd`; packed
  THD sequences with per-sequence positions, :func:`rotate_thd`), and, on megatron's unfused
  ``DotProductAttention``, runs plain causal attention (sliding window included) on torch's fused
  ``scaled_dot_product_attention`` (:func:`sdpa_sbhd`; packed, :func:`sdpa_thd`: one varlen kernel
  on CUDA, per sequence elsewhere);
- :func:`self_attention_class` (``TwinkleSelfAttention``) hands the rotary frequencies to that core
  attention instead of calling megatron's module-level ``apply_rotary_pos_emb``.

Classes that subclass megatron's are built on first use, so importing this module does not import
megatron-core.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

import twinkle_kernels as tk
from twinkle_kernels.packed_attention import packed_attention, select_packed_attention

from ..packing import segments, thd_bounds


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
            scale = _sdpa_scale(self, query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1), (), {})
            if scale is not None:
                window = sliding_window(self)
                impl = packed_attention_impl(query, key, value, window)
                if impl != "sdpa_loop":
                    return packed_attention(query, key, value, cu_q, scale=scale, window=window,
                                            impl=impl).reshape(query.shape[0], -1)
            out = query.new_empty(query.shape[0], query.shape[1] * query.shape[2])
            for a, b in segments(cu_q):
                # [n, 1, heads, dim]: one sequence as a batch of one, causal within itself (and
                # within megatron's sliding window, which its softmax applies per call)
                ctx = super().forward(query[a:b].unsqueeze(1), key[a:b].unsqueeze(1), value[a:b].unsqueeze(1),
                                      None, attn_mask_type=AttnMaskType.causal)
                out[a:b] = ctx.reshape(b - a, -1)
            return out

    return PackedDotProductAttention


def cp_positions(local_len: int, cp_rank: int, cp_size: int, device=None) -> torch.Tensor:
    """Global positions [local_len] of this CP rank's tokens under the load-balanced split."""
    chunk = local_len // 2
    first = torch.arange(chunk, device=device) + cp_rank * chunk
    second = torch.arange(chunk, device=device) + (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([first, second])


@functools.lru_cache(maxsize=None)
def _context_parallel_class() -> type:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
    from megatron.core.transformer.module import MegatronModule

    class ContextParallelAttention(MegatronModule):
        """``core_attention`` for causal self-attention with context parallelism by K/V all-gather.
        query [sq, b, np, hn], key/value [sq, b, ng, hn] (this rank's tokens) -> context
        [sq, b, np * hn]. The layer's sliding window (:func:`layer_window`) masks by global
        position too."""

        def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                     attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                     **kwargs):
            super().__init__(config=config)
            if (attention_dropout if attention_dropout is not None else config.attention_dropout):
                raise ValueError("ContextParallelAttention does not implement attention dropout")
            self.softmax_scale = softmax_scale if softmax_scale is not None else config.kv_channels ** -0.5
            self.cp_group = parallel_state.get_context_parallel_group()
            self.window = layer_window(config, layer_number)

        # (q_freqs, k_freqs, mscale) for this rank's tokens, [T, 1, 1, R] each: left by
        # :class:`ContextParallelSelfAttention` for the next call (packed rows), which rotates q and k
        _twinkle_cp_rope = None

        def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: Optional[torch.Tensor], attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None) -> torch.Tensor:
            if attention_bias is not None:
                raise NotImplementedError("ContextParallelAttention: no attention bias")
            rope, self._twinkle_cp_rope = self._twinkle_cp_rope, None
            cp_size = self.cp_group.size()
            cp_rank = self.cp_group.rank()
            cu = None
            if packed_seq_params is not None:
                # THD: [T, heads, dim], this rank's tokens of the one packed row (chunks r and
                # 2cp - 1 - r of it, as plain rows), with the row's global boundaries
                cu = cp_packed_bounds(packed_seq_params, query.shape[0], cp_size)
                query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            elif rope is not None:
                raise ValueError("ContextParallelAttention: per-token rotary frequencies come with packed_seq_params")
            if rope is not None:
                query, key = rotate_tokens(self, query, key, *rope)
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
            if cu is not None:            # packed: and keys of another sequence
                masked |= sequence_index(cu, k_pos)[None, :] != sequence_index(cu, q_pos)[:, None]
            if self.window is not None:   # and keys `window` or more positions back
                masked |= q_pos[:, None] - k_pos[None, :] >= self.window
            # [b, np, sq, sk], softmax in fp32
            scores = torch.einsum("qbhd,kbhd->bhqk", query.float(), key.float()) * self.softmax_scale
            scores = scores.masked_fill(masked, float("-inf"))
            probs = torch.softmax(scores, dim=-1).to(value.dtype)
            context = torch.einsum("bhqk,kbhd->qbhd", probs, value)
            if cu is not None:
                return context.reshape(sq, heads * dim)
            return context.reshape(sq, b, heads * dim)

    return ContextParallelAttention


def cp_packed_bounds(packed_seq_params, local_len: int, cp_size: int) -> torch.Tensor:
    """The global ``cu_seqlens`` (int64 [N + 1]) of a THD ``packed_seq_params`` under context
    parallelism, checked against this rank's ``local_len`` tokens: the packed row holds
    ``local_len * cp_size`` tokens, rank r its chunks r and ``2cp - 1 - r`` (:func:`cp_positions`),
    sequences crossing chunk boundaries as they like."""
    if packed_seq_params.qkv_format != "thd":
        raise NotImplementedError(f"packed_seq_params.qkv_format={packed_seq_params.qkv_format!r} "
                                  "is not supported under context parallelism (thd)")
    cu_q, cu_kv = thd_bounds(packed_seq_params)
    if cu_kv is not None and cu_kv is not cu_q and not torch.equal(cu_q.cpu(), cu_kv.cpu()):
        raise NotImplementedError("packed self-attention needs cu_seqlens_q == cu_seqlens_kv")
    if int(cu_q[-1]) != local_len * cp_size:
        raise ValueError(f"packed_seq_params.cu_seqlens_q ends at {int(cu_q[-1])}, but the packed row "
                         f"under context parallelism holds {local_len} tokens x cp {cp_size}: cu_seqlens "
                         "must be the global boundaries of the whole row (not divided by cp)")
    if local_len % 2:
        raise ValueError(f"context parallelism needs an even number of tokens per CP rank, got {local_len}")
    return cu_q.long()


def sequence_index(cu: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Which sequence of boundaries ``cu`` ([N + 1]) each global token index in ``positions`` is in."""
    cu = cu.to(device=positions.device, dtype=torch.long)
    return torch.searchsorted(cu[1:], positions, right=True)


def cp_packed_positions(cu: torch.Tensor, local_len: int, cp_rank: int, cp_size: int,
                        device=None) -> torch.Tensor:
    """Positions within their own sequence (int64 [local_len]) of CP rank ``cp_rank``'s tokens of
    a packed row with global boundaries ``cu``: the RoPE positions, restarting at every sample."""
    idx = cp_positions(local_len, cp_rank, cp_size, device)
    cu = cu.to(device=idx.device, dtype=torch.long)
    return idx - cu[sequence_index(cu, idx)]


def rotate_tokens(attn, query: torch.Tensor, key: torch.Tensor, q_freqs: torch.Tensor, k_freqs: torch.Tensor,
                  mscale: float):
    """RoPE of ``query`` [T, B, Hq, D] and ``key`` [T, B, Hk, D] with per-token frequencies
    ``[T, 1, 1, R]``: on twinkle_kernels for a twinkle core attention (``_twinkle_rope_core``, see
    :func:`rotate_sbhd`), else megatron's ``_apply_rotary_pos_emb_bshd`` (what its THD rotary
    runs per sequence). Returns ``(query, key)`` in their dtype."""
    config = attn.config
    if getattr(attn, "_twinkle_rope_core", False) and _fused_rope_ok(config):
        return rotate_sbhd(query, key, q_freqs, k_freqs, mscale)
    from megatron.core.models.common.embeddings import rope_utils
    return (rope_utils._apply_rotary_pos_emb_bshd(query, q_freqs, rotary_interleaved=config.rotary_interleaved,
                                                  mscale=mscale),
            rope_utils._apply_rotary_pos_emb_bshd(key, k_freqs, rotary_interleaved=config.rotary_interleaved,
                                                  mscale=mscale))


def checkpoint_core_attention(attn, attr: str, rope, query, key, value, attention_mask, attn_mask_type,
                               attention_bias, packed_seq_params):
    """``attn.core_attention`` under megatron's selective recompute, with the rotary frequencies
    ``rope`` set as its attribute ``attr`` before each of its calls: the forward, and the rerun in
    the backward (the core attention takes them once per call)."""
    from megatron.core import tensor_parallel
    core = attn.core_attention
    mask_type = attn.attn_mask_type if attn_mask_type is None else attn_mask_type

    def run(q, k, v, mask):
        setattr(core, attr, rope)
        return core(q, k, v, mask, attn_mask_type=mask_type, attention_bias=attention_bias,
                    packed_seq_params=packed_seq_params)

    return tensor_parallel.checkpoint(run, False, query, key, value, attention_mask)


@functools.lru_cache(maxsize=None)
def context_parallel_self_attention_class(base: type) -> type:
    """A subclass of the self-attention class ``base`` (megatron's ``SelfAttention`` or
    :class:`TwinkleSelfAttention`) for a :class:`ContextParallelAttention` core: on packed rows
    under context parallelism (THD ``packed_seq_params`` with the whole row's boundaries), megatron's
    THD rotary would place each sequence's tokens by its own per-sequence CP split, which is not
    the facade's (the row's chunks r and 2cp - 1 - r). So the rotary frequencies are taken at each
    local token's position within its sample (:func:`cp_packed_positions`) and handed to the core
    attention, which rotates q and k (:func:`rotate_tokens`). Everything else goes to ``base``."""

    class ContextParallelSelfAttention(base):
        def forward(self, hidden_states, attention_mask, *args, **kwargs):
            rope = kwargs.get("rotary_pos_emb")
            packed = kwargs.get("packed_seq_params")
            cp = self.config.context_parallel_size
            core = self.core_attention
            if rope is None or packed is None or cp == 1 or not hasattr(core, "_twinkle_cp_rope"):
                return super().forward(hidden_states, attention_mask, *args, **kwargs)
            if args or kwargs.get("inference_context") is not None or kwargs.get("inference_params") is not None:
                raise NotImplementedError("packed rows under context parallelism: no inference caches")
            if self.config.multi_latent_attention or getattr(self.config, "mrope_section", None):
                raise NotImplementedError("packed rows under context parallelism take plain RoPE "
                                          "(no multi-latent attention, no M-RoPE sections)")
            from megatron.core.transformer.attention import _yarn_get_concentration_factor_from_config
            group = core.cp_group
            local_len = hidden_states.shape[0] * (self.config.tensor_model_parallel_size
                                                  if self.config.sequence_parallel else 1)
            cu = cp_packed_bounds(packed, local_len, group.size())
            pos = cp_packed_positions(cu, local_len, group.rank(), group.size())
            q_freqs, k_freqs = rope if isinstance(rope, tuple) else (rope, rope)
            if int(pos.max()) >= min(q_freqs.shape[0], k_freqs.shape[0]):
                raise ValueError(f"rotary table of {q_freqs.shape[0]} positions, a packed sequence reaches "
                                 f"position {int(pos.max())}: packed_seq_params.max_seqlen_q is too small")
            pos = pos.to(q_freqs.device)
            core._twinkle_cp_rope = (q_freqs[pos], k_freqs[pos], _yarn_get_concentration_factor_from_config(self.config))
            try:
                return super().forward(hidden_states, attention_mask, **dict(kwargs, rotary_pos_emb=None))
            finally:
                core._twinkle_cp_rope = None

        def _checkpointed_attention_forward(self, query, key, value, attention_mask, rotary_pos_emb=None,
                                            attn_mask_type=None, attention_bias=None, packed_seq_params=None):
            """Selective recompute of the core attention: the per-token frequencies go to each of
            its calls (the forward, and the rerun in the backward)."""
            core = self.core_attention
            rope = getattr(core, "_twinkle_cp_rope", None)
            if rope is None:
                return super()._checkpointed_attention_forward(
                    query, key, value, attention_mask, rotary_pos_emb=rotary_pos_emb, attn_mask_type=attn_mask_type,
                    attention_bias=attention_bias, packed_seq_params=packed_seq_params)
            return checkpoint_core_attention(self, "_twinkle_cp_rope", rope, query, key, value, attention_mask,
                                             attn_mask_type, attention_bias, packed_seq_params)

    ContextParallelSelfAttention.__name__ = ContextParallelSelfAttention.__qualname__ = \
        f"ContextParallel{base.__name__}"
    return ContextParallelSelfAttention


def _fused_rope_ok(config) -> bool:
    return not (config.rotary_interleaved or config.multi_latent_attention or config.apply_rope_fusion
                or getattr(config, "mrope_section", None))


def rotate_sbhd(query: torch.Tensor, key: torch.Tensor, q_freqs: torch.Tensor, k_freqs: torch.Tensor,
                mscale: float = 1.0):
    """Rotary embedding of ``query`` [S, B, Hq, D] and ``key`` [S, B, Hk, D] with megatron's
    frequencies ``[S, 1, 1, R]`` (``R <= D``, halves duplicated: the rotate-half convention);
    channels past R pass through. Returns ``(query, key)`` in their dtype."""
    if q_freqs is not k_freqs and not torch.equal(q_freqs, k_freqs):
        from megatron.core.models.common.embeddings import rope_utils
        return (rope_utils._apply_rotary_pos_emb_bshd(query, q_freqs, mscale=mscale),
                rope_utils._apply_rotary_pos_emb_bshd(key, k_freqs, mscale=mscale))
    cos, sin = _cos_sin(q_freqs, mscale, query.dtype)
    # cos.unsqueeze(2) is [S, 1, 1, R]: broadcasts over batch and heads of [S, B, H, D].
    return tk.apply_rotary_pos_emb(query, key, cos, sin, unsqueeze_dim=2)


# megatron computes the rotary frequencies once per model forward (its RotaryEmbedding even caches
# them across forwards) and hands the same tensor to every layer: keep the last cos / sin tables.
_TABLES: list = [None]


def _cos_sin(freqs: torch.Tensor, mscale: float, dtype: torch.dtype):
    """``(cos(freqs) * mscale, sin(freqs) * mscale)`` as ``[S, 1, R]`` in ``dtype``; reused while
    the same, unmodified ``freqs`` tensor comes back (identity and version counter). Frequencies
    that require grad are never cached (their tables belong to one autograd graph)."""
    hit = _TABLES[0]
    if (hit is not None and hit[0] is freqs and hit[1] == freqs._version and hit[2] == mscale
            and hit[3] == dtype):
        return hit[4], hit[5]
    f = freqs.reshape(freqs.shape[0], 1, freqs.shape[-1])             # [S, 1, R]
    cos, sin = torch.cos(f), torch.sin(f)
    if mscale != 1.0:
        cos, sin = cos * mscale, sin * mscale
    cos, sin = cos.to(dtype), sin.to(dtype)
    if not freqs.requires_grad:
        _TABLES[0] = (freqs, freqs._version, mscale, dtype, cos, sin)
    return cos, sin


def rotate_thd(query: torch.Tensor, key: torch.Tensor, freqs: torch.Tensor, cu_seqlens: torch.Tensor,
               mscale: float = 1.0):
    """Rotary embedding of packed (THD) ``query`` [T, Hq, D] and ``key`` [T, Hk, D]: token t of the
    sequence starting at ``cu_seqlens[i]`` gets position ``t - cu_seqlens[i]`` of megatron's
    frequencies ``freqs`` [S_max, 1, 1, R] (as megatron's ``_apply_rotary_pos_emb_thd`` without
    context parallelism). Returns ``(query, key)`` in their dtype."""
    t = torch.arange(query.shape[0], device=query.device)
    cu = cu_seqlens.to(device=query.device, dtype=torch.long)
    pos = t - cu[torch.searchsorted(cu[1:], t, right=True)]
    cos, sin = _cos_sin(freqs, mscale, query.dtype)                  # [S_max, 1, R]
    # [T, 1, R] -> unsqueeze(2) [T, 1, 1, R] against [T, 1, H, D]
    q, k = tk.apply_rotary_pos_emb(query.unsqueeze(1), key.unsqueeze(1), cos[pos], sin[pos], unsqueeze_dim=2)
    return q.squeeze(1), k.squeeze(1)


def sdpa_sbhd(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
              window: Optional[int] = None) -> torch.Tensor:
    """Causal attention of megatron's ``[S, B, H, D]`` q / k / v through torch's fused
    ``scaled_dot_product_attention`` (flash attention on CPU, no ``[B, H, S, S]`` score tensor in
    the autograd graph). ``key`` / ``value`` may have fewer heads (GQA: query head h reads kv head
    ``h // (Hq // Hk)``, megatron's ``repeat_interleave``). ``window``: token i also sees only keys
    j with ``i - j < window`` (transformers' sliding window; a ``[S, S]`` bool mask, so SDPA runs
    its masked kernel). Returns ``[S, B, Hq * Dv]``."""
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))     # [B, H, S, D] views
    gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    if window is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, **gqa)
    else:
        i = torch.arange(query.shape[0], device=query.device)
        gap = i[:, None] - i[None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=(gap >= 0) & (gap < window), scale=scale, **gqa)
    s, b, h, d = query.shape[0], query.shape[1], query.shape[2], value.shape[-1]
    return out.permute(2, 0, 1, 3).reshape(s, b, h * d)


def sdpa_thd(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
             scale: float, window: Optional[int] = None) -> torch.Tensor:
    """Causal attention of packed (THD) q [T, Hq, D], k / v [T, Hk, D], each sequence of
    ``cu_seqlens`` attending to itself only (and, with ``window``, to its last ``window`` tokens,
    itself included): one varlen kernel for the pack where :func:`packed_attention_impl` finds one
    (CUDA), else one :func:`sdpa_sbhd` call per sequence (O(sum s_i^2) work, no [T, T] mask).
    Returns ``[T, Hq * Dv]``."""
    impl = packed_attention_impl(query, key, value, window)
    if impl != "sdpa_loop":
        return packed_attention(query, key, value, cu_seqlens, scale=scale, window=window,
                                impl=impl).reshape(query.shape[0], -1)
    out = query.new_empty(query.shape[0], query.shape[1] * value.shape[-1])
    for a, b in segments(cu_seqlens):
        out[a:b] = sdpa_sbhd(query[a:b, None], key[a:b, None], value[a:b, None], scale, window).reshape(b - a, -1)
    return out


def packed_attention_impl(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          window: Optional[int] = None) -> str:
    """How causal attention of a THD pack (q [T, Hq, D], k / v [T, Hk, D]; ``window`` as in
    :func:`sdpa_thd`) runs here: one varlen kernel on CUDA (``"flash_attn_varlen"`` or
    ``"torch_varlen_attn"``), else ``"sdpa_loop"`` (one SDPA per sequence; the path on CPU). See
    ``twinkle_kernels.packed_attention``."""
    return select_packed_attention(query.device, query.dtype, query.shape[-1], query.shape[1], key.shape[1],
                                   head_dim_v=value.shape[-1], window=window).impl


def _causal_form(window_size) -> bool:
    return window_size is None or (tuple(window_size)[1] == 0 and tuple(window_size)[0] >= -1)


def causal_window(window_size) -> Optional[int]:
    """The sliding window ``W`` (a query at position i sees keys j with ``0 <= i - j < W``,
    transformers' ``sliding_window``) of megatron's ``window_size`` ``(W - 1, 0)``; None for no
    window (None or ``(-1, 0)``). Any other ``window_size`` (keys to the right of the query) is
    not causal self-attention: ValueError naming it."""
    if window_size is None:
        return None
    left, right = window_size
    if not _causal_form(window_size):
        raise ValueError(f"window_size={tuple(window_size)} is not supported (a causal sliding window "
                         "(sliding_window - 1, 0) or none)")
    return None if left == -1 else left + 1


def layer_window(config, layer_number: int) -> Optional[int]:
    """:func:`causal_window` of the layer ``layer_number`` (1-based, global) of ``config``: its
    ``window_size`` where megatron's ``is_layer_window_attention`` gives that layer the window
    (``window_attn_skip_freq``), else None."""
    from megatron.core.transformer.utils import is_layer_window_attention
    if not is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
        return None
    return causal_window(config.window_size)


def sliding_window(attn) -> Optional[int]:
    """:func:`causal_window` of the window megatron's ``DotProductAttention`` ``attn`` applies (its
    softmax's ``window_size``, set per layer from the config)."""
    return causal_window(getattr(getattr(attn, "scale_mask_softmax", None), "window_size", None))


def _sdpa_scale(attn, query, key, value, args, kwargs) -> Optional[float]:
    """The softmax scale when megatron's ``DotProductAttention`` ``attn`` would compute exactly
    causal softmax attention for this call (what :func:`sdpa_sbhd` computes), else None."""
    from megatron.core.transformer.enums import AttnMaskType
    mask = args[0] if args else kwargs.get("attention_mask")
    softmax = getattr(attn, "scale_mask_softmax", None)
    if (mask is not None or len(args) > 1 or softmax is None
            or kwargs.get("attention_bias") is not None or kwargs.get("packed_seq_params") is not None
            # megatron's softmax uses the mask type the module was built with, not the argument
            or attn.attn_mask_type != AttnMaskType.causal
            # a causal sliding window is the callers' to apply (sliding_window); others are not
            or not _causal_form(getattr(softmax, "window_size", None))
            or getattr(attn, "softmax_offset", None) is not None
            or (attn.training and attn.attention_dropout.p > 0)
            or query.shape[0] != key.shape[0] or key.shape[0] != value.shape[0]
            or query.shape[2] % key.shape[2] or key.shape[2] != value.shape[2]
            or not (query.dtype == key.dtype == value.dtype)
            # the CPU (flash) and CUDA kernels, GQA included; NPU attention has its own patches
            or query.device.type not in ("cpu", "cuda")):
        return None
    # megatron: scores * softmax_scale, then * coeff inside the softmax (query-key layer scaling)
    return attn.softmax_scale * (softmax.scale if softmax.scale is not None else 1.0)


@functools.lru_cache(maxsize=None)
def rope_core_attention(base: type) -> type:
    """A subclass of the core-attention class ``base`` that first rotates q and k with the
    frequencies :class:`TwinkleSelfAttention` left for it (one call per forward). When ``base`` is
    megatron's unfused ``DotProductAttention`` and the call is plain causal softmax attention (no
    mask tensor, bias, sink offset or active dropout; the layer's causal sliding window is applied
    too), the attention itself runs on torch's
    fused ``scaled_dot_product_attention`` (:func:`sdpa_sbhd`; packed THD sequences one by one,
    :func:`sdpa_thd`) instead of megatron's baddbmm / masked softmax / bmm; everything else goes
    to ``base``."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class RopeCoreAttention(base):
        _twinkle_rope = None
        _twinkle_rope_core = True
        # Class switch (benchmark ablations): fused attention for DotProductAttention calls.
        _twinkle_sdpa = issubclass(base, DotProductAttention)

        def forward(self, query, key, value, *args, **kwargs):
            rope, self._twinkle_rope = self._twinkle_rope, None
            cu = None
            if rope is not None:
                q_freqs, k_freqs, mscale, cu = rope
                if cu is None:
                    query, key = rotate_sbhd(query, key, q_freqs, k_freqs, mscale)
                else:
                    query, key = rotate_thd(query, key, q_freqs, cu, mscale)
            if self._twinkle_sdpa:
                packed = kwargs.get("packed_seq_params")
                if packed is None:
                    scale = _sdpa_scale(self, query, key, value, args, kwargs)
                    if scale is not None:
                        return sdpa_sbhd(query, key, value, scale, sliding_window(self))
                elif packed.qkv_format == "thd" and query.dim() == 3:
                    if cu is None:  # TwinkleSelfAttention found them already when it handed over the rotary
                        cu = _thd_self_attention_cu(packed, self.config)
                    scale = None if cu is None else _sdpa_scale(
                        self, query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1), args,
                        dict(kwargs, packed_seq_params=None))
                    if scale is not None and int(cu[-1]) == query.shape[0]:
                        return sdpa_thd(query, key, value, cu, scale, sliding_window(self))
            return super().forward(query, key, value, *args, **kwargs)

    RopeCoreAttention.__name__ = RopeCoreAttention.__qualname__ = f"TwinkleRope{base.__name__}"
    return RopeCoreAttention


def _self_attention_class():
    from megatron.core.transformer.attention import SelfAttention

    class TwinkleSelfAttention(SelfAttention):
        """SelfAttention whose rotary embedding runs in the core attention on twinkle_kernels."""

        def forward(self, hidden_states, attention_mask, *args, **kwargs):
            rope = kwargs.get("rotary_pos_emb")
            packed = kwargs.get("packed_seq_params")
            usable = (rope is not None and not args and getattr(self.core_attention, "_twinkle_rope_core", False)
                      and kwargs.get("inference_context") is None
                      and kwargs.get("inference_params") is None
                      and kwargs.get("key_value_states") is None
                      and _fused_rope_ok(self.config))
            cu = None
            if usable and packed is not None and packed.qkv_format == "thd":
                cu = _thd_self_attention_cu(packed, self.config)
                usable = cu is not None
            if not usable:
                return super().forward(hidden_states, attention_mask, *args, **kwargs)
            from megatron.core.transformer.attention import _yarn_get_concentration_factor_from_config
            q_freqs, k_freqs = rope if isinstance(rope, tuple) else (rope, rope)
            if cu is not None and q_freqs is not k_freqs and not torch.equal(q_freqs, k_freqs):
                return super().forward(hidden_states, attention_mask, *args, **kwargs)
            self.core_attention._twinkle_rope = (
                q_freqs, k_freqs, _yarn_get_concentration_factor_from_config(self.config), cu)
            kwargs["rotary_pos_emb"] = None
            try:
                return super().forward(hidden_states, attention_mask, **kwargs)
            finally:
                self.core_attention._twinkle_rope = None

        def _checkpointed_attention_forward(self, query, key, value, attention_mask, rotary_pos_emb=None,
                                            attn_mask_type=None, attention_bias=None, packed_seq_params=None):
            """Selective recompute of the core attention (megatron's ``core_attn``) with the fused
            rotary: its frequencies go to one core-attention call, and the rerun in the backward
            is another call, so each call of the checkpointed function hands them over again."""
            core = self.core_attention
            rope = core._twinkle_rope
            if rope is None:
                return super()._checkpointed_attention_forward(
                    query, key, value, attention_mask, rotary_pos_emb=rotary_pos_emb, attn_mask_type=attn_mask_type,
                    attention_bias=attention_bias, packed_seq_params=packed_seq_params)
            return checkpoint_core_attention(self, "_twinkle_rope", rope, query, key, value, attention_mask,
                                             attn_mask_type, attention_bias, packed_seq_params)

    return TwinkleSelfAttention


def _thd_self_attention_cu(packed, config) -> Optional[torch.Tensor]:
    """The ``cu_seqlens`` of a THD self-attention call the fused rotary can serve (one CP rank,
    equal query / key boundaries), else None (megatron's own THD rotary runs)."""
    if config.context_parallel_size > 1:
        return None
    cu_q, cu_k = thd_bounds(packed)
    if cu_q is None or (cu_k is not None and cu_k is not cu_q and not torch.equal(cu_q, cu_k)):
        return None
    return cu_q


@functools.lru_cache(maxsize=None)
def self_attention_class() -> type:
    return _self_attention_class()


@functools.lru_cache(maxsize=None)
def _latent_class() -> type:
    from megatron.core.transformer.module import MegatronModule

    class LatentCoreAttention(MegatronModule):
        """Causal core attention with query / key heads of ``k_channels`` and value heads of
        ``v_channels`` (multi-latent attention: megatron's ``MLASelfAttention`` builds its core
        attention with both, which megatron's local ``DotProductAttention`` does not take).
        q / k ``[S, B, H, k_channels]``, v ``[S, B, H, v_channels]`` -> ``[S, B, H * v_channels]``
        (packed THD: ``[T, H, ...]`` -> ``[T, H * v_channels]``), scores times ``softmax_scale``,
        softmax in the input dtype's SDPA (fp32 math for fp32). No mask beyond causal, no dropout."""

        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                     softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None):
            from megatron.core.transformer.enums import AttnMaskType
            super().__init__(config=config)
            if attn_mask_type != AttnMaskType.causal:
                raise ValueError(f"LatentCoreAttention is causal only, got attn_mask_type={attn_mask_type}")
            if (config.attention_dropout if attention_dropout is None else attention_dropout) > 0:
                raise ValueError("LatentCoreAttention has no attention dropout (attention_dropout must be 0)")
            if config.context_parallel_size > 1:
                raise NotImplementedError("multi-latent attention with context parallelism is not supported")
            if layer_window(config, layer_number) is not None:
                raise NotImplementedError("LatentCoreAttention has no sliding window (sliding_window must be "
                                          f"null; window_size={config.window_size})")
            # (megatron's Attention base first builds its core attention without the channel sizes,
            # then MLA builds it again with them: None means 1 / sqrt(query head size) at the call)
            self.softmax_scale = softmax_scale

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if attention_mask is not None or attention_bias is not None:
                raise NotImplementedError("LatentCoreAttention takes no attention mask or bias (causal only)")
            scale = self.softmax_scale if self.softmax_scale is not None else query.shape[-1] ** -0.5
            if packed_seq_params is not None:
                cu_q, _ = thd_bounds(packed_seq_params)
                return sdpa_thd(query, key, value, cu_q, scale)
            return sdpa_sbhd(query, key, value, scale)

    return LatentCoreAttention


def latent_core_attention_class() -> type:
    """:class:`LatentCoreAttention` (built on first use)."""
    return _latent_class()


def __getattr__(name):
    # Classes built lazily: megatron-core is imported only when the attention is used.
    if name == "PackedDotProductAttention":
        return _packed_class()
    if name == "ContextParallelAttention":
        return _context_parallel_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
