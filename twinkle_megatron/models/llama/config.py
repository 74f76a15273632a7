"""Llama, Qwen2 and Qwen3 configs: dense GQA decoders that differ in two flags and Qwen's
optional sliding window."""
from __future__ import annotations

from .. import common
from ..shape import ModelShape

MODEL_TYPES = ("llama", "qwen2", "qwen3")
QKV_BIAS = ("qwen2",)   # q/k/v projections with a bias (others: the config's attention_bias)
QK_NORM = ("qwen3",)    # RMSNorm on each head of q and k
SLIDING = ("qwen2", "qwen3")   # a sliding window on some layers (transformers' Llama has none)


def model_shape(cfg: dict) -> ModelShape:
    model_type = cfg["model_type"]
    _, rope_theta = common.rope_parameters(cfg)
    fields = common.shape_fields(cfg, model_type, rope_theta)
    fields["qkv_bias"] = model_type in QKV_BIAS or fields["qkv_bias"]
    if model_type in SLIDING:
        fields.update(sliding_window_fields(cfg))
    return ModelShape(**fields, qk_norm=model_type in QK_NORM)


def sliding_window_fields(cfg: dict) -> dict:
    """Qwen2 / Qwen3's window as their transformers configs resolve it: ``sliding_window`` only
    with ``use_sliding_window``, in the "sliding_attention" ``layer_types`` (by default the layers
    from ``max_window_layers`` on)."""
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
    types = cfg.get("layer_types")
    if types is None:
        start = cfg.get("max_window_layers", 28)
        types = ["sliding_attention" if window is not None and i >= start else "full_attention"
                 for i in range(cfg["num_hidden_layers"])]
    return common.sliding_window_fields(cfg, window, types)


def transformer_fields(shape: ModelShape) -> dict:
    return common.window_transformer_fields(shape)
