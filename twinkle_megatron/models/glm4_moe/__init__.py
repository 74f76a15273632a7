"""GLM-4.5 / GLM-4.6 MoE: GQA attention (q/k/v bias, optional q/k norms, partial rotary), dense
first layers, then sigmoid-routed experts with a score-correction bias, group-limited top-k and
an ungated shared expert."""
from __future__ import annotations

from ..family import Family
from . import config, lora, spec, state_dict_adapter

FAMILY = Family(name="glm4_moe", model_types=config.MODEL_TYPES, model_shape=config.model_shape,
                transformer_fields=config.transformer_fields, layer_specs=spec.layer_specs,
                layer_table=state_dict_adapter.layer_table, model_table=state_dict_adapter.model_table,
                lora_unsupported=lora.UNSUPPORTED, model_linears=lora.model_linears)
