"""megatron-core layer specs whose hot ops run on twinkle_kernels, chosen when the model is built.

Nothing global is modified: :func:`twinkle_layer_spec` takes a megatron layer ``ModuleSpec``
(e.g. from ``get_gpt_layer_local_spec``) and returns a copy in which

- every RMSNorm (input, pre-MLP, q/k, final) is :class:`TwinkleRMSNorm` (``tk.rms_norm``; plain or
  zero-centred from ``config.layernorm_zero_centered_gamma``; sequence-parallel aware);
- self-attention is :class:`TwinkleSelfAttention`, which hands the rotary frequencies to its core
  attention instead of calling megatron's module-level ``apply_rotary_pos_emb``; the core attention
  (megatron's, or the facade's CP one) is subclassed to rotate q and k with
  ``tk.apply_rotary_pos_emb`` in megatron's ``[S, B, H, D]`` layout, full or partial rotary; on
  megatron's unfused ``DotProductAttention`` plain causal attention runs on torch's fused
  ``scaled_dot_product_attention`` (the local spec materialises ``[B, H, S, S]`` scores);
- the dense MLP is :class:`TwinkleMLP`: ``tk.swiglu_packed`` on fc1's packed ``[gate | up]`` output;
- MoE experts (``SequentialMLP``) become :class:`twinkle_megatron.specs_moe.TwinkleGroupedMLP`
  (``tk.grouped_matmul``, see there);
- megatron's ``GatedDeltaNet`` becomes :class:`twinkle_megatron.specs_gdn.TwinkleGatedDeltaNet`
  (``tk.causal_conv1d``, ``tk.chunk_gated_delta_rule``, ``tk.gated_rms_norm``).

Packed THD sequences rotate with per-sequence positions from ``cu_seqlens`` (:func:`rotate_thd`).
Cases the fused paths do not cover (interleaved or MLA rotary, THD under context parallelism,
inference caches, recomputed core attention, biased/clamped GLUs) fall through to megatron's own code, so the
spec never changes what a model computes, only where.

:class:`TwinkleSpecProvider` exposes the same choices through megatron's ``BackendSpecProvider``
interface for spec builders that take a ``backend=``.
"""
from __future__ import annotations

import copy
import functools
from typing import Optional

import torch
import torch.nn.functional as F

import twinkle_kernels as tk

from .hf_config import RMSNorm


class TwinkleRMSNorm(RMSNorm):
    """RMSNorm over the last dim through ``tk.rms_norm``. Signature and parameters as the local
    spec's :class:`twinkle_megatron.hf_config.RMSNorm`: ``(config, hidden_size, eps,
    zero_centered=None)``; with ``config.layernorm_zero_centered_gamma`` (or ``zero_centered=True``)
    the weight starts at 0 and the scale is ``1 + weight`` (Qwen3.5 / Qwen3-Next)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tk.rms_norm(x, self.weight, self.eps, offset=1.0 if self.zero_centered else 0.0)


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


def sdpa_sbhd(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of megatron's ``[S, B, H, D]`` q / k / v through torch's fused
    ``scaled_dot_product_attention`` (flash attention on CPU, no ``[B, H, S, S]`` score tensor in
    the autograd graph). ``key`` / ``value`` may have fewer heads (GQA: query head h reads kv head
    ``h // (Hq // Hk)``, megatron's ``repeat_interleave``). Returns ``[S, B, Hq * Dv]``."""
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))     # [B, H, S, D] views
    gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, **gqa)
    s, b, h, d = query.shape[0], query.shape[1], query.shape[2], value.shape[-1]
    return out.permute(2, 0, 1, 3).reshape(s, b, h * d)


def sdpa_thd(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
             scale: float) -> torch.Tensor:
    """Causal attention of packed (THD) q [T, Hq, D], k / v [T, Hk, D], each sequence of
    ``cu_seqlens`` attending to itself only (one :func:`sdpa_sbhd` call per sequence: O(sum s_i^2)
    work, no [T, T] mask). Returns ``[T, Hq * Dv]``."""
    from .packing import segments
    out = query.new_empty(query.shape[0], query.shape[1] * value.shape[-1])
    for a, b in segments(cu_seqlens):
        out[a:b] = sdpa_sbhd(query[a:b, None], key[a:b, None], value[a:b, None], scale).reshape(b - a, -1)
    return out


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
            or getattr(softmax, "window_size", None) is not None
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
    mask tensor, bias, window, sink offset or active dropout), the attention itself runs on torch's
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
                        return sdpa_sbhd(query, key, value, scale)
                elif packed.qkv_format == "thd" and query.dim() == 3:
                    if cu is None:  # TwinkleSelfAttention found them already when it handed over the rotary
                        cu = _thd_self_attention_cu(packed, self.config)
                    scale = None if cu is None else _sdpa_scale(
                        self, query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1), args,
                        dict(kwargs, packed_seq_params=None))
                    if scale is not None and int(cu[-1]) == query.shape[0]:
                        return sdpa_thd(query, key, value, cu, scale)
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
                      and not (self.checkpoint_core_attention and self.training)
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

    return TwinkleSelfAttention


def _thd_self_attention_cu(packed, config) -> Optional[torch.Tensor]:
    """The ``cu_seqlens`` of a THD self-attention call the fused rotary can serve (one CP rank,
    equal query / key boundaries), else None (megatron's own THD rotary runs)."""
    if config.context_parallel_size > 1:
        return None
    from .packing import thd_bounds
    cu_q, cu_k = thd_bounds(packed)
    if cu_q is None or (cu_k is not None and cu_k is not cu_q and not torch.equal(cu_q, cu_k)):
        return None
    return cu_q


@functools.lru_cache(maxsize=None)
def self_attention_class() -> type:
    return _self_attention_class()


@functools.lru_cache(maxsize=None)
def mlp_class() -> type:
    from megatron.core.transformer.mlp import MLP

    class TwinkleMLP(MLP):
        """megatron's MLP with the gated SiLU on ``tk.swiglu_packed`` (fc1 emits ``[gate | up]``,
        each half TP-sharded: megatron's packed layout)."""

        def forward(self, hidden_states, per_token_scale=None, **kwargs):
            c = self.config
            if not (c.gated_linear_unit and c.activation_func is F.silu and not c.add_bias_linear
                    and per_token_scale is None and not c.use_te_activation_func
                    and getattr(c, "activation_func_clamp_value", None) is None
                    and not getattr(c, "glu_linear_offset", 0.0)):
                return super().forward(hidden_states, per_token_scale=per_token_scale, **kwargs)
            h, _ = self.linear_fc1(hidden_states)
            return self.linear_fc2(tk.swiglu_packed(h))

    return TwinkleMLP


def twinkle_layer_spec(spec, *, experts: bool = True):
    """A copy of the megatron layer spec ``spec`` with the twinkle_kernels modules substituted
    (see the module docstring). ``experts=False`` keeps megatron's expert MLPs."""
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP
    spec = copy.deepcopy(spec)
    sub = spec.submodules

    def norm(x):
        return x if x is None or x is IdentityOp or _is_layernorm_linear(x) else TwinkleRMSNorm

    sub.input_layernorm = norm(sub.input_layernorm)
    sub.pre_mlp_layernorm = norm(sub.pre_mlp_layernorm)
    attn = sub.self_attention
    if getattr(attn, "module", None) is SelfAttention:
        attn.module = self_attention_class()
        a = attn.submodules
        a.q_layernorm = norm(a.q_layernorm)
        a.k_layernorm = norm(a.k_layernorm)
        if isinstance(a.core_attention, type):
            a.core_attention = rope_core_attention(a.core_attention)
    else:
        from . import specs_gdn
        if specs_gdn.is_gated_delta_net(getattr(attn, "module", None)):
            sub.self_attention = specs_gdn.gated_delta_net_spec(attn)
    mlp = sub.mlp
    if getattr(mlp, "module", None) is MLP:
        mlp.module = mlp_class()
    elif experts and mlp is not None and getattr(mlp, "submodules", None) is not None \
            and getattr(mlp.submodules, "experts", None) is not None:
        from . import specs_moe
        mlp.submodules.experts = specs_moe.expert_spec(mlp.submodules.experts)
    return spec


def _is_layernorm_linear(x) -> bool:
    return isinstance(x, type) and "LayerNormLinear" in x.__name__


def final_norm() -> type:
    """The block's final norm."""
    return TwinkleRMSNorm


def _local_provider_base():
    from megatron.core.models.backends import LocalSpecProvider
    return LocalSpecProvider


class TwinkleSpecProvider(_local_provider_base()):
    """megatron's LocalSpecProvider with twinkle_kernels' RMSNorm and rotary core attention."""

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        return TwinkleRMSNorm if rms_norm else super().layer_norm(rms_norm=rms_norm, for_qk=for_qk)

    def core_attention(self) -> type:
        return rope_core_attention(super().core_attention())


def describe(module: torch.nn.Module) -> Optional[str]:
    """Which twinkle modules a built model contains, e.g. for logs: ``'TwinkleRMSNorm x9, ...'``."""
    counts = {}
    for m in module.modules():
        name = type(m).__name__
        if name.startswith("Twinkle"):
            counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())) or None
