"""Llama, Qwen2 and Qwen3 configs: dense GQA decoders that differ only in two flags."""
from __future__ import annotations

from .. import common
from ..shape import ModelShape

MODEL_TYPES = ("llama", "qwen2", "qwen3")
QKV_BIAS = ("qwen2",)   # q/k/v projections with a bias (others: the config's attention_bias)
QK_NORM = ("qwen3",)    # RMSNorm on each head of q and k


def model_shape(cfg: dict) -> ModelShape:
    model_type = cfg["model_type"]
    _, rope_theta = common.rope_parameters(cfg)
    fields = common.shape_fields(cfg, model_type, rope_theta)
    fields["qkv_bias"] = model_type in QKV_BIAS or fields["qkv_bias"]
    return ModelShape(**fields, qk_norm=model_type in QK_NORM)


def transformer_fields(shape: ModelShape) -> dict:
    return {}
