"""Layer specs: a Gated DeltaNet layer where ``layer_types`` says linear attention, gated full
attention elsewhere (Qwen3.5's specs); the MLP an MoE (megatron's router collecting the aux-loss
statistics) or, in the dense layers, a SwiGLU MLP."""
from __future__ import annotations

from typing import List

from ... import spec
from ...layers.router import router_class
from ..shape import ModelShape
from .config import is_moe


def layer_specs(shape: ModelShape, backend: spec.LocalSpecProvider) -> List:
    full = {False: spec.attention_layer_spec(backend, qk_norm=True)}
    if shape.num_experts:
        full[True] = spec.attention_layer_spec(backend, qk_norm=True, num_experts=shape.num_experts,
                                               router=router_class())
    linear = {moe: spec.gdn_layer_spec(s, backend) for moe, s in full.items()}
    return [(linear if shape.is_linear(i) else full)[is_moe(shape, i)] for i in range(shape.num_layers)]
