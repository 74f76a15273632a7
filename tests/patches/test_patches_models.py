"""Tiny models of every patched family, built from configs with random weights (no hub).

Shared by the twinkle_patches tests; this file itself holds no tests.
"""
from __future__ import annotations

import importlib

import pytest
import torch

VOCAB = 64


def _cfg(family: str):
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False)
    if family == "llama":
        from transformers import LlamaConfig
        return LlamaConfig(intermediate_size=48, **common)
    if family == "qwen2":
        from transformers import Qwen2Config
        return Qwen2Config(intermediate_size=48, **common)
    if family == "qwen3":
        from transformers import Qwen3Config
        return Qwen3Config(intermediate_size=48, head_dim=8, **common)
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        # layer 0 dense (Qwen3MoeMLP), layer 1 sparse (Qwen3MoeExperts)
        return Qwen3MoeConfig(intermediate_size=48, head_dim=8, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=16, mlp_only_layers=[0], **common)
    gdn = dict(layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4, linear_num_key_heads=2,
               linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, head_dim=16,
               partial_rotary_factor=0.25)
    if family == "qwen3_next":
        from transformers import Qwen3NextConfig
        return Qwen3NextConfig(intermediate_size=48, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                               shared_expert_intermediate_size=16, mlp_only_layers=[0], **gdn, **common)
    if family == "qwen3_5":
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
        return Qwen3_5TextConfig(intermediate_size=48, **gdn, **common)
    if family == "qwen3_5_moe":
        from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
        return Qwen3_5MoeTextConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                    shared_expert_intermediate_size=16, **gdn, **common)
    if family == "mixtral":
        from transformers import MixtralConfig
        return MixtralConfig(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, **common)
    if family == "glm4_moe":
        from transformers import Glm4MoeConfig
        # layer 0 dense (Glm4MoeMLP, also the shared expert), layer 1 MoE; q/k norms, partial rotary
        return Glm4MoeConfig(intermediate_size=48, moe_intermediate_size=16, n_routed_experts=4,
                             num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, head_dim=8,
                             use_qk_norm=True, attention_bias=True, **common)
    if family == "deepseek_v3":
        from transformers import DeepseekV3Config
        # rope_interleave=False: the path that calls apply_rotary_pos_emb; layer 0 dense, layer 1 MoE
        return DeepseekV3Config(intermediate_size=48, moe_intermediate_size=16, n_routed_experts=4,
                                num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
                                first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                                qk_nope_head_dim=8, v_head_dim=8, rope_interleave=False,
                                **{**common, "num_key_value_heads": 4})  # MLA: one KV head per head
    raise KeyError(family)


_CAUSAL_LM = {
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM", "qwen3_next": "Qwen3NextForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM", "mixtral": "MixtralForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
}
FAMILY_NAMES = tuple(_CAUSAL_LM)


def build(family: str, seed: int = 0, dtype=torch.float32):
    """A 2-layer causal LM of ``family`` with seeded random weights, eager attention, in ``dtype``."""
    try:
        mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    except ImportError as e:  # an older transformers without this family
        pytest.skip(f"{family} is not in this transformers: {e}")
    cfg = _cfg(family)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(mod, _CAUSAL_LM[family])(cfg)
    with torch.no_grad():  # zero-centred norms start at 0 and experts may start empty: perturb every weight
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.to(dtype)


def batch(seed: int = 1, b: int = 2, t: int = 11):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (b, t), generator=g)


def assert_unpatched_mishandles_packing(run, alone: torch.Tensor) -> None:
    """The precondition of the packed-GDN tests: unpatched transformers gets a packed batch wrong.

    Its torch Gated DeltaNet path refuses ``cu_seqlens`` with a ValueError (5.23) or ignores them,
    mixing the samples (5.17); either way it is the patch that makes packing right.
    """
    try:
        out = run()
    except ValueError as e:
        assert "packed sequences" in str(e), e
        return
    leak = float((out - alone).abs().max())
    assert leak > 1e-2, "unpatched transformers now handles packed GDN batches: this test needs a new baseline"

