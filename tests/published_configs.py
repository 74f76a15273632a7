"""Published architectures, written out as their ``config.json`` values, and how far CI cuts them.

``PUBLISHED[name]`` is the text model's config as released (the fields a ``config.json`` of that
checkpoint carries that change the architecture; token ids and generation fields left out). The
Qwen3.5 entries are transformers' ``Qwen3_5TextConfig()`` / ``Qwen3_5MoeTextConfig()`` defaults,
read from the installed package and written out here so that a change there shows up as a test
failure rather than a silently different model.

``CUTS[name]`` is what the CI tests change so a random-weight fp32 copy fits a 2-core, 24 GB
machine (and the reason); :func:`cut` applies it. Depth is always cut (1-2 layers; hybrids keep
one Gated DeltaNet and one attention layer). Widths (hidden, heads, head_dim, intermediate and
expert sizes, kv heads, rope) are never cut. Where the vocabulary or the expert count is cut as
well, the entry says so: Qwen3-0.6B keeps its full 151,936-row (tied) embedding.
"""
from __future__ import annotations

import copy

PUBLISHED = {
    # Qwen/Qwen3-0.6B: head_dim 128 != hidden / heads = 64; tied embeddings
    "qwen3_0_6b": dict(
        model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=1024,
        intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, hidden_act="silu", max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_theta=1000000.0, rope_scaling=None, attention_bias=False, tie_word_embeddings=True,
        use_sliding_window=False, sliding_window=None, max_window_layers=28),
    # Qwen/Qwen3-4B: tied embeddings, 32 query / 8 kv heads of 128
    "qwen3_4b": dict(
        model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=2560,
        intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, hidden_act="silu", max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_theta=1000000.0, rope_scaling=None, attention_bias=False, tie_word_embeddings=True,
        use_sliding_window=False, sliding_window=None, max_window_layers=36),
    # Qwen/Qwen3-30B-A3B: every layer MoE, 128 experts of 768, top-8 renormalised
    "qwen3_30b_a3b": dict(
        model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048,
        intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, hidden_act="silu",
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None,
        attention_bias=False, tie_word_embeddings=False, router_aux_loss_coef=0.001,
        output_router_logits=False, use_sliding_window=False, sliding_window=None, max_window_layers=48),
    # meta-llama/Llama-3.1-8B: llama3 RoPE scaling, 128,256-token vocabulary, eps 1e-5
    "llama3_1_8b": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                               high_freq_factor=4.0, original_max_position_embeddings=8192),
        attention_bias=False, mlp_bias=False, pretraining_tp=1, tie_word_embeddings=False),
    # transformers' Qwen3_5TextConfig(): 3 Gated DeltaNet layers per gated-attention layer,
    # 16 key / 32 value GDN heads of 128, attention head_dim 256 with 1/4 partial rotary
    "qwen3_5_text": dict(
        model_type="qwen3_5_text", vocab_size=248320, hidden_size=4096, intermediate_size=12288,
        num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
        hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
        attention_bias=False, tie_word_embeddings=False, linear_conv_kernel_dim=4,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
        linear_num_value_heads=32, full_attention_interval=4),
    # transformers' Qwen3_5MoeTextConfig(): the hybrid with 256 experts of 512, top-8, and a
    # sigmoid-gated shared expert of 512
    "qwen3_5_moe_text": dict(
        model_type="qwen3_5_moe_text", vocab_size=248320, hidden_size=2048, num_hidden_layers=40,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, hidden_act="silu",
        max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
        attention_bias=False, tie_word_embeddings=False, linear_conv_kernel_dim=4,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
        linear_num_value_heads=32, full_attention_interval=4, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, num_experts_per_tok=8, num_experts=256,
        router_aux_loss_coef=0.001, output_router_logits=False),
}

HYBRID_CUT = ["linear_attention", "full_attention"]   # one of each, in the published order
CUT_VOCAB = 32000   # even (TP2), not a power of two

CUTS = {
    "qwen3_0_6b": dict(layers=2, why="depth only (the full 28 layers run benchmark-side)"),
    "qwen3_4b": dict(layers=2, vocab_size=CUT_VOCAB,
                     why="2 layers; the tied 151,936 x 2560 embedding (1.6 GB fp32) cut to the CI "
                         "vocabulary (qwen3_0_6b keeps the full one)"),
    "qwen3_30b_a3b": dict(layers=1, vocab_size=CUT_VOCAB,
                          why="1 layer (all 128 experts: 2.4 GB fp32); the untied 151,936 x 2048 "
                              "embedding and head (2.5 GB fp32) cut to the CI vocabulary"),
    "llama3_1_8b": dict(layers=1, vocab_size=CUT_VOCAB,
                        why="1 layer (TP2 only: a 2-layer copy for PP2 is another 0.9 GB fp32); the untied "
                            "128,256 x 4096 embedding and head (4.2 GB fp32) cut to the CI vocabulary"),
    "qwen3_5_text": dict(layers=2, vocab_size=CUT_VOCAB,
                         why="one GDN and one attention layer; the untied 248,320 x 4096 embedding "
                             "and head (8.1 GB fp32) cut to the CI vocabulary"),
    "qwen3_5_moe_text": dict(layers=2, vocab_size=CUT_VOCAB, num_experts=32,
                             why="one GDN and one attention layer; 32 of the 256 experts (256 x 2 layers "
                                 "would be 6.4 GB fp32); the vocabulary cut as for qwen3_5_text"),
}


def cut(name: str) -> dict:
    """The config CI builds for ``name``: :data:`PUBLISHED` with :data:`CUTS` applied."""
    cfg = copy.deepcopy(PUBLISHED[name])
    c = CUTS[name]
    cfg["num_hidden_layers"] = c["layers"]
    if "full_attention_interval" in cfg:
        cfg.pop("full_attention_interval")
        cfg["layer_types"] = list(HYBRID_CUT[-c["layers"]:])
    for key in ("vocab_size", "num_experts"):
        if key in c:
            cfg[key] = c[key]
    for key in ("max_window_layers",):
        if key in cfg:
            cfg[key] = c["layers"]
    return cfg


def is_moe(name: str) -> bool:
    return bool(PUBLISHED[name].get("num_experts"))


def is_hybrid(name: str) -> bool:
    return "full_attention_interval" in PUBLISHED[name]
