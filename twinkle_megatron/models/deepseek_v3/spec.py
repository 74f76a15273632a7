"""Layer specs: megatron's multi-latent self-attention (its column / row parallel linears, RMSNorms
of the q and kv latents, :class:`~twinkle_megatron.layers.attention.LatentCoreAttention`; it
applies its own RoPE) in every layer; a dense MLP in the first ``first_k_dense`` layers, an MoE
(routed and shared experts) after them."""
from __future__ import annotations

from typing import List

from ... import spec
from ...layers.attention import latent_core_attention_class
from ...layers.router import router_class
from ..shape import ModelShape


def mla_self_attention(backend: spec.LocalSpecProvider, *, q_lora: bool):
    """``q_lora``: the queries come through a latent (``q_lora_rank`` set), which has a norm; without
    one no q norm is named (megatron-core 0.19 refuses a q norm it would not use)."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    column, norm = backend.column_parallel_linear(), backend.layer_norm(rms_norm=True, for_qk=True)
    return ModuleSpec(module=MLASelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                      submodules=MLASelfAttentionSubmodules(
                          linear_q_proj=column, linear_q_down_proj=column, linear_q_up_proj=column,
                          linear_kv_down_proj=column, linear_kv_up_proj=column,
                          core_attention=latent_core_attention_class(), linear_proj=backend.row_parallel_linear(),
                          q_layernorm=norm if q_lora else IdentityOp, kv_layernorm=norm))


def layer_specs(shape: ModelShape, backend: spec.LocalSpecProvider) -> List:
    dense = spec.attention_layer_spec(backend, qk_norm=False)
    moe = spec.attention_layer_spec(backend, qk_norm=False, num_experts=shape.num_experts, router=router_class())
    for layer in (dense, moe):
        layer.submodules.self_attention = mla_self_attention(
            backend, q_lora=shape.family_field("q_lora_rank") is not None)
        layer.submodules.sharded_state_dict_keys_map = {}
    return [moe if shape.is_moe(i) else dense for i in range(shape.num_layers)]
