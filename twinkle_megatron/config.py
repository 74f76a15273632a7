"""Hugging Face config <-> megatron-core config: what a model is, not how its layers are built.

:func:`load_hf_config` reads a ``config.json``; :func:`model_shape` turns it into a
:class:`ModelShape` (what the weight converter and the spec builder need to know);
:func:`transformer_config` makes megatron's ``TransformerConfig`` for a shape and a mesh. The layer
specs are built in :mod:`twinkle_megatron.spec`.

Supported families: Llama, Qwen2 (qkv bias), Qwen3 (q/k RMSNorm), Qwen3-MoE (MoE layers with the
alltoall dispatcher, one MLP per expert), and the Qwen3.5 hybrid, dense or MoE (``qwen3_5_text`` /
``qwen3_5_moe_text``, or the text part of a ``qwen3_5`` / ``qwen3_5_moe`` config): Gated DeltaNet
layers interleaved with gated full attention, zero-centred RMSNorms and partial rotary (see
:mod:`twinkle_megatron.layers.gated_delta_net`).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Tuple, Union

import torch
import torch.nn.functional as F

from .validate import read_json

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_5_text", "qwen3_5",
                         "qwen3_5_moe_text", "qwen3_5_moe")
HYBRID_MODEL_TYPES = ("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe")
MOE_MODEL_TYPES = ("qwen3_moe", "qwen3_5_moe_text", "qwen3_5_moe")


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the weight converter needs to know about an HF model, read from its config.json."""
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    num_experts: int = 0
    moe_intermediate_size: int = 0
    moe_topk: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0   # Qwen3.5-MoE: a sigmoid-gated shared expert
    # Qwen3.5 hybrid: per-layer "linear_attention" (Gated DeltaNet) / "full_attention"; empty for
    # the all-attention families.
    layer_types: Tuple[str, ...] = ()
    linear_conv_kernel_dim: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    partial_rotary_factor: float = 1.0
    zero_centered_norm: bool = False        # RMSNorm scale is (1 + weight)
    attention_output_gate: bool = False     # q_proj also emits a per-head sigmoid output gate
    hf_prefix: str = "model."               # where the decoder's weights live in the HF checkpoint

    @property
    def hybrid(self) -> bool:
        return bool(self.layer_types)

    def is_linear(self, layer: int) -> bool:
        """Whether global layer ``layer`` (0-based) is a Gated DeltaNet layer."""
        return bool(self.layer_types) and self.layer_types[layer] == "linear_attention"


def load_hf_config(model_dir_or_config: Union[str, os.PathLike, dict]) -> dict:
    """Read ``config.json`` from a directory (or accept the dict itself / a transformers config)."""
    if hasattr(model_dir_or_config, "to_dict"):
        return model_dir_or_config.to_dict()
    if isinstance(model_dir_or_config, dict):
        return dict(model_dir_or_config)
    path = os.fspath(model_dir_or_config)
    cfg_file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(f"model_dir_or_config: no config.json at {cfg_file!r}")
    return read_json(cfg_file, "model_dir_or_config")


def model_shape(cfg: dict) -> ModelShape:
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type={model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}")
    prefix = "model."
    if model_type in ("qwen3_5", "qwen3_5_moe"):
        # The composite (vision + text) config: the decoder is its text part, stored under
        # model.language_model.* in the checkpoint.
        text = dict(cfg.get("text_config") or {})
        if not text:
            raise ValueError(f"model_type={model_type!r} config has no text_config")
        if "tie_word_embeddings" in cfg:
            text.setdefault("tie_word_embeddings", cfg["tie_word_embeddings"])
        cfg, prefix = text, "model.language_model."
    hybrid = model_type in HYBRID_MODEL_TYPES
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None):
        raise ValueError(f"rope_type={rope_type!r} is not supported yet (only default RoPE)")
    rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    heads = cfg["num_attention_heads"]
    moe = model_type in MOE_MODEL_TYPES
    if moe and (cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1):
        raise ValueError("qwen3_moe with dense layers (mlp_only_layers / decoder_sparse_step) "
                         "is not supported yet")
    hybrid_kwargs = {}
    if hybrid:
        hybrid_kwargs = _hybrid_fields(cfg, rope)
    return ModelShape(
        model_type=model_type,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        # Qwen3.5-MoE has no dense MLP (every layer is MoE): megatron still wants an ffn size
        intermediate_size=cfg.get("intermediate_size") or cfg["moe_intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe") or hybrid,
        num_experts=(cfg.get("num_experts") or cfg.get("num_local_experts") or 0) if moe else 0,
        moe_intermediate_size=cfg.get("moe_intermediate_size", 0) if moe else 0,
        moe_topk=cfg.get("num_experts_per_tok", 0) if moe else 0,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0) if hybrid and moe else 0,
        hf_prefix=prefix,
        **hybrid_kwargs,
    )


def _hybrid_fields(cfg: dict, rope: dict) -> dict:
    """The Qwen3.5 hybrid fields of ModelShape, with transformers' defaults."""
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


def transformer_config(shape: ModelShape, mesh, *, params_dtype: torch.dtype, on_cpu: bool):
    """megatron's ``TransformerConfig`` for ``shape`` laid out on ``mesh`` (a
    :class:`twinkle_megatron.DeviceMesh`), with the fusions that need TransformerEngine or apex off
    and the per-token loss megatron's schedules sum over micro-batches."""
    from megatron.core.transformer import TransformerConfig
    kwargs = {}
    if shape.num_experts:
        kwargs.update(
            num_moe_experts=shape.num_experts,
            moe_ffn_hidden_size=shape.moe_intermediate_size,
            moe_router_topk=shape.moe_topk,
            # softmax over the top-k logits == softmax over all, top-k, renormalise (norm_topk_prob)
            moe_router_pre_softmax=not shape.norm_topk_prob,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="alltoall",
            moe_grouped_gemm=False,
            moe_permute_fusion=False,
            moe_router_dtype="fp32",
        )
        if shape.shared_expert_intermediate_size:
            kwargs.update(moe_shared_expert_intermediate_size=shape.shared_expert_intermediate_size,
                          moe_shared_expert_gate=True)
    if shape.hybrid:
        kwargs.update(
            experimental_attention_variant="gated_delta_net",
            linear_attention_freq=[1 if t == "linear_attention" else 0 for t in shape.layer_types],
            linear_conv_kernel_dim=shape.linear_conv_kernel_dim,
            linear_key_head_dim=shape.linear_key_head_dim,
            linear_value_head_dim=shape.linear_value_head_dim,
            linear_num_key_heads=shape.linear_num_key_heads,
            linear_num_value_heads=shape.linear_num_value_heads,
        )
    if shape.zero_centered_norm:
        kwargs["layernorm_zero_centered_gamma"] = True
    if shape.attention_output_gate:
        kwargs["attention_output_gate"] = True
    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.intermediate_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        layernorm_epsilon=shape.rms_norm_eps,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        tensor_model_parallel_size=mesh.tp_size,
        pipeline_model_parallel_size=mesh.pp_size,
        virtual_pipeline_model_parallel_size=mesh.vpp_size if mesh.vpp_size > 1 else None,
        context_parallel_size=mesh.cp_size,
        expert_model_parallel_size=mesh.ep_size,
        expert_tensor_parallel_size=mesh.etp_size,
        sequence_parallel=mesh.sequence_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=on_cpu,
        calculate_per_token_loss=True,
        # Over gloo, batched p2p swaps messages with interleaved PP (wrong loss, no error).
        batch_p2p_comm=False,
        batch_p2p_sync=False,
        **kwargs,
    )
