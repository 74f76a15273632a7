"""Qwen3-MoE configs: Qwen3 attention (q/k RMSNorm) and routed experts in every layer."""
from __future__ import annotations

from .. import common
from ..shape import ModelShape

MODEL_TYPES = ("qwen3_moe",)


def model_shape(cfg: dict) -> ModelShape:
    _, rope_theta = common.rope_parameters(cfg)
    common.check_all_moe(cfg)
    return ModelShape(**common.shape_fields(cfg, cfg["model_type"], rope_theta), qk_norm=True,
                      **common.moe_fields(cfg))


def transformer_fields(shape: ModelShape) -> dict:
    return common.moe_transformer_fields(shape)
