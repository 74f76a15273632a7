"""Mixtral configs: GQA attention without q/k norms, and ``num_local_experts`` routed experts of
``intermediate_size`` each in every layer, routed by a softmax over all experts, top-k and
renormalised (transformers' ``MixtralTopKRouter``); ``sliding_window`` (when set) in every layer."""
from __future__ import annotations

from .. import common
from ..shape import ModelShape

MODEL_TYPES = ("mixtral",)


def model_shape(cfg: dict) -> ModelShape:
    _, rope_theta = common.rope_parameters(cfg)
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={cfg.get('hidden_act')!r} is not supported (silu)")
    fields = common.shape_fields(cfg, cfg["model_type"], rope_theta)
    fields.update(common.moe_fields(cfg), moe_intermediate_size=cfg["intermediate_size"],
                  norm_topk_prob=True,   # Mixtral always renormalises its top-k weights
                  **common.sliding_window_fields(cfg, cfg.get("sliding_window")))   # in every layer
    return ModelShape(**fields, qk_norm=False)


def transformer_fields(shape: ModelShape) -> dict:
    return {**common.moe_transformer_fields(shape), **common.window_transformer_fields(shape)}
