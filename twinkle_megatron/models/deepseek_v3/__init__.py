"""DeepSeek-V3: multi-latent attention (megatron's MLA modules, yarn RoPE), dense first layers,
then sigmoid-routed experts with a score-correction bias, group-limited top-k and shared experts."""
from __future__ import annotations

from ..family import Family
from . import config, lora, spec, state_dict_adapter

FAMILY = Family(name="deepseek_v3", model_types=config.MODEL_TYPES, model_shape=config.model_shape,
                transformer_fields=config.transformer_fields, layer_specs=spec.layer_specs,
                layer_table=state_dict_adapter.layer_table, model_table=state_dict_adapter.model_table,
                lora_unsupported=lora.UNSUPPORTED, model_linears=lora.model_linears)
