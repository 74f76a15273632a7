"""Qwen3-MoE configs: Qwen3 attention (q/k RMSNorm) and routed experts in every layer."""
from __future__ import annotations

from .. import common
from ..shape import ModelShape

MODEL_TYPES = ("qwen3_moe",)


def model_shape(cfg: dict) -> ModelShape:
    _, rope_theta = common.rope_parameters(cfg)
    common.check_all_moe(cfg)
    # transformers' Qwen3-MoE: sliding_window with use_sliding_window, in every layer
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
    return ModelShape(**common.shape_fields(cfg, cfg["model_type"], rope_theta), qk_norm=True,
                      **common.moe_fields(cfg), **common.sliding_window_fields(cfg, window))


def transformer_fields(shape: ModelShape) -> dict:
    return {**common.moe_transformer_fields(shape), **common.window_transformer_fields(shape)}
