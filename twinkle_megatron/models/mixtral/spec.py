"""Layer specs: full attention and an MoE (megatron's router collecting the aux-loss statistics)."""
from __future__ import annotations

from typing import List

from ... import spec
from ...layers.router import router_class
from ..shape import ModelShape


def layer_specs(shape: ModelShape, backend: spec.LocalSpecProvider) -> List:
    layer = spec.attention_layer_spec(backend, qk_norm=False, num_experts=shape.num_experts,
                                      router=router_class())
    return [layer] * shape.num_layers
