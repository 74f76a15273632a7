"""Mixtral: Llama attention and routed experts (softmax top-k, renormalised; no shared expert) in every layer."""
from __future__ import annotations

from ..family import Family
from . import config, lora, spec, state_dict_adapter

FAMILY = Family(name="mixtral", model_types=config.MODEL_TYPES, model_shape=config.model_shape,
                transformer_fields=config.transformer_fields, layer_specs=spec.layer_specs,
                layer_table=state_dict_adapter.layer_table, model_table=state_dict_adapter.model_table,
                lora_unsupported=lora.UNSUPPORTED, model_linears=lora.model_linears,
                checkpoint_renames=state_dict_adapter.CHECKPOINT_RENAMES)
