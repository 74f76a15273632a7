"""Qwen3.5 configs, dense or MoE: Gated DeltaNet layers interleaved with gated full attention,
zero-centred RMSNorms and partial rotary; the composite (vision + text) configs are read from
their text part, whose weights live under ``model.language_model.``."""
from __future__ import annotations

from .. import common
from ..shape import ModelShape

MODEL_TYPES = ("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe")
COMPOSITE = ("qwen3_5", "qwen3_5_moe")          # vision + text: the decoder is the text_config
MOE = ("qwen3_5_moe_text", "qwen3_5_moe")       # routed experts and a sigmoid-gated shared expert


def model_shape(cfg: dict) -> ModelShape:
    model_type = cfg["model_type"]
    prefix = "model."
    if model_type in COMPOSITE:
        text = dict(cfg.get("text_config") or {})
        if not text:
            raise ValueError(f"model_type={model_type!r} config has no text_config")
        if "tie_word_embeddings" in cfg:
            text.setdefault("tie_word_embeddings", cfg["tie_word_embeddings"])
        cfg, prefix = text, "model.language_model."
    rope, rope_theta = common.rope_parameters(cfg)
    moe = model_type in MOE
    if moe:
        common.check_all_moe(cfg)
    hybrid = hybrid_fields(cfg, rope)
    fields = common.shape_fields(cfg, model_type, rope_theta)
    if moe:
        fields.update(common.moe_fields(cfg),
                      shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0))
    return ModelShape(**fields, qk_norm=True, hf_prefix=prefix, **hybrid)


def hybrid_fields(cfg: dict, rope: dict) -> dict:
    """The hybrid fields of ModelShape, with transformers' defaults (Qwen3-Next's config reads them here too)."""
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        interval = cfg.get("full_attention_interval", 4)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    types = tuple(types)
    if len(types) != n or set(types) - {"linear_attention", "full_attention"}:
        raise ValueError(f"layer_types must list {n} entries of 'linear_attention' / 'full_attention', "
                         f"got {list(types)}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={cfg.get('hidden_act')!r} is not supported (silu)")
    if rope.get("mrope_section") and not rope.get("mrope_interleaved", True):
        # Text-only positions are equal on the three M-RoPE axes, which makes interleaved M-RoPE
        # plain RoPE; the chunked (non-interleaved) layout is not handled here.
        raise ValueError("non-interleaved M-RoPE is not supported")
    return dict(
        layer_types=types,
        linear_conv_kernel_dim=cfg.get("linear_conv_kernel_dim", 4),
        linear_key_head_dim=cfg.get("linear_key_head_dim", 128),
        linear_value_head_dim=cfg.get("linear_value_head_dim", 128),
        linear_num_key_heads=cfg.get("linear_num_key_heads", 16),
        linear_num_value_heads=cfg.get("linear_num_value_heads", 32),
        partial_rotary_factor=float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))),
        zero_centered_norm=True,
        attention_output_gate=True,
    )


def transformer_fields(shape: ModelShape) -> dict:
    """megatron's Gated DeltaNet layers where ``layer_types`` has linear attention (and the MoE)."""
    fields = dict(
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=[1 if t == "linear_attention" else 0 for t in shape.layer_types],
        linear_conv_kernel_dim=shape.linear_conv_kernel_dim,
        linear_key_head_dim=shape.linear_key_head_dim,
        linear_value_head_dim=shape.linear_value_head_dim,
        linear_num_key_heads=shape.linear_num_key_heads,
        linear_num_value_heads=shape.linear_num_value_heads,
    )
    if shape.num_experts:
        fields.update(common.moe_transformer_fields(shape))
    return fields
