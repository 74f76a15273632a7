"""Layer specs: full attention everywhere; a dense MLP in the first ``first_k_dense`` layers, an
MoE (routed and shared experts) after them."""
from __future__ import annotations

from typing import List

from ... import spec
from ...layers.router import router_class
from ..shape import ModelShape


def layer_specs(shape: ModelShape, backend: spec.LocalSpecProvider) -> List:
    dense = spec.attention_layer_spec(backend, qk_norm=shape.qk_norm)
    moe = spec.attention_layer_spec(backend, qk_norm=shape.qk_norm, num_experts=shape.num_experts,
                                    router=router_class())
    return [moe if shape.is_moe(i) else dense for i in range(shape.num_layers)]
