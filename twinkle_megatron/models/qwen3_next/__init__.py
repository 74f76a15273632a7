"""Qwen3-Next: Gated DeltaNet layers interleaved with gated full attention, a high-sparsity MoE with
a sigmoid-gated shared expert (dense MLPs where ``mlp_only_layers`` / ``decoder_sparse_step`` say)."""
from __future__ import annotations

from ..family import Family
from . import config, lora, spec, state_dict_adapter

FAMILY = Family(name="qwen3_next", model_types=config.MODEL_TYPES, model_shape=config.model_shape,
                transformer_fields=config.transformer_fields, layer_specs=spec.layer_specs,
                layer_table=state_dict_adapter.layer_table, model_table=state_dict_adapter.model_table,
                lora_unsupported=lora.UNSUPPORTED, model_linears=lora.model_linears)
