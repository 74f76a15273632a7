"""Pieces the Llama-lineage families share: the config fields every one reads alike, the MoE
fields, and the name-table entries of their common modules (embeddings, RMSNorms, GQA attention,
SwiGLU MLPs, routed experts). A family folder composes them; nothing here knows a model type."""
from __future__ import annotations

from typing import Dict, List, Tuple

from .shape import ModelShape
from .table import Entry, Table

# Hugging Face modules no family's LoRA can adapt, and why (see twinkle_megatron.lora)
UNSUPPORTED = {"embed_tokens": "the embeddings", "lm_head": "the LM head"}
MOE_UNSUPPORTED = {
    "mlp.gate": "the MoE router (megatron's TopKRouter applies its weight directly, not through a linear layer)",
    "mlp.experts": "routed experts through target_modules (transformers keeps them as fused "
                   "parameters: target them with target_parameters=['mlp.experts.gate_up_proj', "
                   "'mlp.experts.down_proj'], as peft does)",
}


# ---- config translation ---------------------------------------------------------------------

# megatron's RotaryEmbedding applies llama3 scaling with these fixed (Llama-3.1 / 3.2's values)
LLAMA3_FIXED = dict(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


def rope_parameters(cfg: dict) -> Tuple[dict, float]:
    """``(rope parameters, rope_theta)`` of an HF text config: default RoPE, or llama3 scaling
    with the fields megatron fixes (:data:`LLAMA3_FIXED`); anything else is a ValueError."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None, "llama3"):
        raise ValueError(f"rope_type={rope_type!r} is not supported yet (default RoPE or llama3)")
    if rope_type == "llama3":
        other = {k: rope.get(k) for k, v in LLAMA3_FIXED.items() if float(rope.get(k, -1)) != v}
        if other:
            raise ValueError(f"llama3 RoPE scaling with {other} is not supported (megatron fixes "
                             f"{LLAMA3_FIXED})")
    return rope, float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def rope_scaling_factor(rope: dict) -> float:
    """The llama3 scaling factor of :func:`rope_parameters`' dict (0.0: no scaling)."""
    return float(rope["factor"]) if rope.get("rope_type", rope.get("type")) == "llama3" else 0.0


def shape_fields(cfg: dict, model_type: str, rope_theta: float) -> dict:
    """The :class:`ModelShape` fields every family reads the same way from its text config."""
    heads = cfg["num_attention_heads"]
    return dict(
        model_type=model_type,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        # an all-MoE model has no dense MLP: megatron still wants an ffn size
        intermediate_size=cfg.get("intermediate_size") or cfg["moe_intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", False)),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        rope_scaling_factor=rope_scaling_factor(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}),
    )


SLIDING_LAYER_TYPES = ("full_attention", "sliding_attention")


def sliding_window_fields(cfg: dict, window, layer_types=None) -> dict:
    """The :class:`ModelShape` sliding-window fields: ``window`` (transformers' effective
    ``sliding_window``, None for none) in every layer, or with ``layer_types`` (transformers'
    per-layer "full_attention" / "sliding_attention") in the sliding ones. Empty when no layer has
    a window; a window that transformers would reject (not a positive int, sliding layers without
    one) is a ValueError naming ``sliding_window``."""
    n = cfg["num_hidden_layers"]
    if layer_types is None:
        layers = tuple(range(n))
    else:
        layer_types = list(layer_types)
        if len(layer_types) != n or set(layer_types) - set(SLIDING_LAYER_TYPES):
            raise ValueError(f"layer_types must list {n} entries of {' / '.join(map(repr, SLIDING_LAYER_TYPES))}, "
                             f"got {layer_types}")
        layers = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
        if layers and window is None:
            raise ValueError(f"layer_types has sliding_attention layers {list(layers)} but sliding_window is "
                             "null (or use_sliding_window is false)")
    if window is None or not layers:
        return {}
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window must be a positive int or null, got {window!r}")
    return dict(sliding_window=window, sliding_window_layers=layers)


def window_transformer_fields(shape: ModelShape) -> dict:
    """megatron ``TransformerConfig`` fields of ``shape``'s sliding window: ``window_size =
    (sliding_window - 1, 0)`` (megatron's window keeps keys j with ``i - j <= window_size[0]``,
    transformers' keeps ``i - j < sliding_window``), on the ``window_attn_skip_freq`` layers (1:
    windowed) when not every layer has it. The core attentions of
    :mod:`twinkle_megatron.layers.attention` apply it."""
    if not shape.sliding_window:
        return {}
    fields = dict(window_size=(shape.sliding_window - 1, 0))
    if len(shape.sliding_window_layers) != shape.num_layers:
        fields["window_attn_skip_freq"] = [int(i in shape.sliding_window_layers) for i in range(shape.num_layers)]
    return fields


def check_all_moe(cfg: dict) -> None:
    """Refuse MoE configs with dense layers among the MoE ones (not built here yet)."""
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        raise ValueError("qwen3_moe with dense layers (mlp_only_layers / decoder_sparse_step) "
                         "is not supported yet")


def moe_fields(cfg: dict) -> dict:
    """The routed-experts fields of :class:`ModelShape` (every layer an MoE layer)."""
    return dict(num_experts=cfg.get("num_experts") or cfg.get("num_local_experts") or 0,
                moe_intermediate_size=cfg.get("moe_intermediate_size", 0),
                moe_topk=cfg.get("num_experts_per_tok", 0))


def routing_fields(cfg: dict, model_type: str) -> dict:
    """The :class:`ModelShape` fields of DeepSeek-V3-style routing (GLM-4.5 MoE, DeepSeek-V3):
    sigmoid scores, a score-correction bias that only chooses, group-limited top-k, scaled
    weights, dense first layers and an ungated shared expert; checked against what megatron's
    router computes."""
    if not cfg.get("norm_topk_prob", True):
        raise ValueError(f"{model_type} with norm_topk_prob=False is not supported (megatron's sigmoid "
                         "router always renormalises its top-k weights)")
    groups, group_topk = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    topk, experts = cfg["num_experts_per_tok"], cfg["n_routed_experts"]
    if groups > 1 and (experts % groups or topk % group_topk or topk // group_topk != 2):
        raise ValueError(f"{model_type}: n_group={groups}, topk_group={group_topk} with num_experts_per_tok="
                         f"{topk} is not supported (transformers scores a group by its 2 best experts, "
                         "megatron by its num_experts_per_tok / topk_group best: they must be 2)")
    return dict(num_experts=experts, moe_intermediate_size=cfg["moe_intermediate_size"], moe_topk=topk,
                norm_topk_prob=True, router_score_function="sigmoid", router_expert_bias=True,
                router_num_groups=groups if groups > 1 else 0, router_group_topk=group_topk if groups > 1 else 0,
                routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                first_k_dense=int(cfg.get("first_k_dense_replace", 0)),
                shared_expert_intermediate_size=cfg["moe_intermediate_size"] * int(cfg.get("n_shared_experts") or 0),
                shared_expert_gated=False)


def moe_transformer_fields(shape: ModelShape) -> dict:
    """megatron ``TransformerConfig`` fields of an MoE model routed as transformers routes it, with
    megatron's own aux losses off (the facade adds transformers' pooled one:
    ``training/aux_loss.py``)."""
    fields = dict(
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
        fields.update(moe_shared_expert_intermediate_size=shape.shared_expert_intermediate_size,
                      moe_shared_expert_gate=shape.shared_expert_gated)
    if shape.router_score_function != "softmax":
        fields["moe_router_score_function"] = shape.router_score_function
    if shape.router_expert_bias:
        # the bias only chooses experts, and stays what the checkpoint says (transformers does not
        # update it; megatron's own update rule would move it every step)
        fields.update(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.0)
    if shape.router_num_groups > 1:
        fields.update(moe_router_num_groups=shape.router_num_groups, moe_router_group_topk=shape.router_group_topk)
    if shape.routed_scaling_factor != 1.0:
        fields["moe_router_topk_scaling_factor"] = shape.routed_scaling_factor
    if shape.first_k_dense:
        fields["moe_layer_freq"] = [0 if i < shape.first_k_dense else 1 for i in range(shape.num_layers)]
    return fields


# ---- name table -------------------------------------------------------------------------------

def model_table(shape: ModelShape) -> Table:
    """Embeddings, final norm and LM head (full names; the LM head reads the embeddings when tied)."""
    p = shape.hf_prefix
    tied = shape.tie_word_embeddings
    return {
        "embedding.word_embeddings.weight": Entry((p + "embed_tokens.weight",), "column"),
        "decoder.final_layernorm.weight": Entry((p + "norm.weight",)),
        "output_layer.weight": Entry((p + "embed_tokens.weight",) if tied else ("lm_head.weight",), "column",
                                     export=not tied),
    }


def model_linears(shape: ModelShape) -> Tuple[List[str], List[str]]:
    """The HF linear-like modules outside the layers that peft sees: (before them, after them)."""
    return [shape.hf_prefix + "embed_tokens"], ["lm_head"]


def norm_entries() -> Table:
    return {"input_layernorm.weight": Entry(("input_layernorm.weight",)),
            "pre_mlp_layernorm.weight": Entry(("post_attention_layernorm.weight",))}


def attention_entries(shape: ModelShape, *, gated: bool = False) -> Table:
    """GQA self-attention: fused ``linear_qkv`` (and its bias with ``shape.qkv_bias``), ``linear_proj``,
    q/k RMSNorms with ``shape.qk_norm``; ``gated``: q_proj also carries the per-head output gate."""
    layout = "gated_qkv" if gated else "qkv"
    out = {"self_attention.linear_qkv.weight":
           Entry(tuple(f"self_attn.{x}_proj.weight" for x in "qkv"), layout, linear=True)}
    if shape.qkv_bias:
        out["self_attention.linear_qkv.bias"] = Entry(tuple(f"self_attn.{x}_proj.bias" for x in "qkv"), layout)
    out["self_attention.linear_proj.weight"] = Entry(("self_attn.o_proj.weight",), "row", linear=True)
    if shape.qk_norm:
        out["self_attention.q_layernorm.weight"] = Entry(("self_attn.q_norm.weight",))
        out["self_attention.k_layernorm.weight"] = Entry(("self_attn.k_norm.weight",))
    return out


def mlp_entries(megatron: str = "mlp.", hf: str = "mlp.") -> Table:
    """A SwiGLU MLP: megatron's ``[gate; up]`` fc1 and fc2 (also a shared expert, under other names)."""
    return {f"{megatron}linear_fc1.weight": Entry((f"{hf}gate_proj.weight", f"{hf}up_proj.weight"), "sections",
                                                  linear=True),
            f"{megatron}linear_fc2.weight": Entry((f"{hf}down_proj.weight",), "row", linear=True)}


def moe_entries(gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj") -> Table:
    """The router and the routed experts: megatron's per-expert fc1 / fc2, HF's per-expert
    ``mlp.experts.{e}.<gate|up|down>.weight`` (Mixtral's checkpoints name them w1 / w3 / w2) or
    transformers' fused ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``."""
    return {
        "mlp.router.weight": Entry(("mlp.gate.weight",), linear=True),
        "mlp.experts.local_experts.*.linear_fc1.weight": Entry(
            (f"mlp.experts.{{e}}.{gate}.weight", f"mlp.experts.{{e}}.{up}.weight"), "sections", expert=True,
            fused="mlp.experts.gate_up_proj", linear=True),
        "mlp.experts.local_experts.*.linear_fc2.weight": Entry(
            (f"mlp.experts.{{e}}.{down}.weight",), "row", expert=True, fused="mlp.experts.down_proj", linear=True),
    }


def biased_moe_entries(shape: ModelShape) -> Table:
    """DeepSeek-V3-style MoE (GLM-4.5 MoE, DeepSeek-V3): the router's weight and its
    score-correction bias (megatron's ``expert_bias`` buffer), routed experts and the ungated
    shared expert."""
    out = {**moe_entries(),
           "mlp.router.expert_bias": Entry(("mlp.gate.e_score_correction_bias",))}
    if shape.shared_expert_intermediate_size:
        out.update(mlp_entries("mlp.shared_experts.", "mlp.shared_experts."))
    return out


def unsupported(*parts: Dict[str, str]) -> Dict[str, str]:
    out = dict(UNSUPPORTED)
    for p in parts:
        out.update(p)
    return out
