"""DeepSeek-V3 configs (transformers' ``DeepseekV3Config``): multi-latent attention and
DeepSeek-style routing (see :func:`twinkle_megatron.models.common.routing_fields`).

Attention, as ``DeepseekV3Attention`` computes it and megatron's ``MLASelfAttention`` with an
``MLATransformerConfig`` does: q from ``q_b_proj(norm(q_a_proj(x)))`` (or ``q_proj(x)`` without
``q_lora_rank``), k / v from ``kv_b_proj(norm(latent))`` with ``kv_a_proj_with_mqa(x) = [latent;
k_rope]``, RoPE on the ``qk_rope_head_dim`` channels read interleaved (``rope_interleave``, which
megatron's MLA always does), default or yarn RoPE (inverse frequencies with the correction ramp,
cos / sin times ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``, softmax scale times
``mscale(factor, mscale_all_dim) ** 2``). The multi-token-prediction layers of the checkpoints
(``num_nextn_predict_layers``) are not built, as transformers does not build them either: their
weights are not read.
"""
from __future__ import annotations

from .. import common
from ..shape import ModelShape

MODEL_TYPES = ("deepseek_v3",)


def _rope_fields(cfg: dict) -> dict:
    """megatron's MLA RoPE fields for the config's default or yarn RoPE (what transformers computes)."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return dict(rope_type="rope", rotary_base=theta, rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    if rope_type != "yarn":
        raise ValueError(f"deepseek_v3 with rope_type={rope_type!r} is not supported (default or yarn)")
    if rope.get("attention_factor") is not None:
        raise ValueError("deepseek_v3 yarn RoPE with an explicit attention_factor is not supported")
    if not rope.get("truncate", True):
        raise ValueError("deepseek_v3 yarn RoPE with truncate=False is not supported")
    original = int(rope["original_max_position_embeddings"])
    factor = rope.get("factor") or cfg["max_position_embeddings"] / original
    mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    # transformers: cos / sin times mscale(f, mscale) / mscale(f, mscale_all_dim) when both are
    # set, else mscale(f, 1); megatron always takes the ratio, so (1, 0) gives the latter
    both = bool(mscale and all_dim)
    return dict(rope_type="yarn", rotary_base=theta, rotary_scaling_factor=float(factor),
                original_max_position_embeddings=original,
                beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
                mscale=float(mscale) if both else 1.0,
                # the softmax scale reads mscale_all_dim alone (0: unchanged), in both
                mscale_all_dim=float(all_dim or 0.0) if (both or not mscale) else 0.0)


def model_shape(cfg: dict) -> ModelShape:
    model_type = cfg["model_type"]
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={cfg.get('hidden_act')!r} is not supported (silu)")
    if not cfg.get("rope_interleave", True):
        raise ValueError("deepseek_v3 with rope_interleave=False is not supported (megatron's multi-latent "
                         "attention reads the rotary channels interleaved, as the checkpoints do)")
    if cfg.get("attention_bias", False):
        raise ValueError("deepseek_v3 with attention_bias=True is not supported (megatron's MLA has no bias)")
    rope = _rope_fields(cfg)
    fields = common.shape_fields(cfg, model_type, rope["rotary_base"])
    heads = cfg["num_attention_heads"]
    qk_nope, qk_rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    fields.update(common.routing_fields(cfg, model_type), num_kv_heads=heads, head_dim=qk_nope + qk_rope)
    mla = dict(multi_latent_attention=True, q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=cfg["kv_lora_rank"],
               qk_head_dim=qk_nope, qk_pos_emb_head_dim=qk_rope, v_head_dim=v, **rope)
    return ModelShape(**fields, qk_norm=False, family_fields=tuple(sorted(mla.items())))


def transformer_fields(shape: ModelShape) -> dict:
    # qk_layernorm: the q / kv latent norms, which DeepSeek-V3 always has; megatron-core 0.19 builds
    # them only with it set (versions.CHANGES["mla_latent_norms"]; earlier releases ignore it for MLA)
    return {**common.moe_transformer_fields(shape), **dict(shape.family_fields), "qk_layernorm": True}
