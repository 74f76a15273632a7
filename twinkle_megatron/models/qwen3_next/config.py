"""Qwen3-Next configs (transformers' ``Qwen3NextConfig``).

The math is Qwen3.5-MoE's where the two agree, and its pieces are reused there: zero-centred
RMSNorms, the Gated DeltaNet (same conv, decay, gated output norm), gated attention with partial
rotary, softmax top-k routing and a sigmoid-gated shared expert. What differs: the Gated DeltaNet
input projections are grouped per key head (``in_proj_qkvz`` = ``[q_g, k_g, v_g, z_g]``,
``in_proj_ba`` = ``[b_g, a_g]`` per key head g, see ``state_dict_adapter``), ``norm_topk_prob``
may be off, and layers in ``mlp_only_layers`` or off the ``decoder_sparse_step`` keep a dense MLP.
"""
from __future__ import annotations

from .. import common
from ..qwen3_5 import config as qwen3_5_config
from ..shape import ModelShape

MODEL_TYPES = ("qwen3_next",)


def dense_layers(cfg: dict) -> tuple:
    """The layers with a dense MLP, as ``Qwen3NextDecoderLayer`` chooses them."""
    n, step = cfg["num_hidden_layers"], cfg.get("decoder_sparse_step", 1) or 1
    only = set(cfg.get("mlp_only_layers") or ())
    experts = cfg.get("num_experts", 0) or 0
    return tuple(i for i in range(n) if i in only or not (experts > 0 and (i + 1) % step == 0))


def model_shape(cfg: dict) -> ModelShape:
    rope, rope_theta = common.rope_parameters(cfg)
    hybrid = qwen3_5_config.hybrid_fields(cfg, rope)
    fields = common.shape_fields(cfg, cfg["model_type"], rope_theta)
    fields.update(common.moe_fields(cfg), shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0))
    return ModelShape(**fields, qk_norm=True, **hybrid, family_fields=(("dense_layers", dense_layers(cfg)),))


def is_moe(shape: ModelShape, layer: int) -> bool:
    return bool(shape.num_experts) and layer not in shape.family_field("dense_layers")


def transformer_fields(shape: ModelShape) -> dict:
    """megatron's Gated DeltaNet layers where ``layer_types`` has linear attention, the MoE where
    :func:`is_moe`."""
    fields = qwen3_5_config.transformer_fields(shape)   # the same Gated DeltaNet layers
    if shape.num_experts:
        fields.update(moe_layer_freq=[1 if is_moe(shape, i) else 0 for i in range(shape.num_layers)])
    return fields
