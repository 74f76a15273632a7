"""Layer specs: every layer is full attention with a dense SwiGLU MLP."""
from __future__ import annotations

from typing import List

from ... import spec
from ..shape import ModelShape


def layer_specs(shape: ModelShape, backend: spec.LocalSpecProvider) -> List:
    return [spec.attention_layer_spec(backend, qk_norm=shape.qk_norm)] * shape.num_layers
