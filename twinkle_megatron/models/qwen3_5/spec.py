"""Layer specs: a Gated DeltaNet layer where ``layer_types`` says linear attention, gated full
attention elsewhere; the MLP dense or MoE (megatron's router collecting the aux-loss statistics)."""
from __future__ import annotations

from typing import List

from ... import spec
from ...layers.router import router_class
from ..shape import ModelShape


def layer_specs(shape: ModelShape, backend: spec.LocalSpecProvider) -> List:
    full = spec.attention_layer_spec(backend, qk_norm=shape.qk_norm, num_experts=shape.num_experts,
                                     router=router_class() if shape.num_experts else None)
    linear = spec.gdn_layer_spec(full, backend)
    return [linear if shape.is_linear(i) else full for i in range(shape.num_layers)]
