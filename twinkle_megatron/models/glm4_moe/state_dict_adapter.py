"""The HF <-> megatron name table (see :mod:`twinkle_megatron.models.table`): the router's
score-correction bias is megatron's ``expert_bias`` buffer, the shared expert an ungated MLP."""
from __future__ import annotations

from .. import common
from ..shape import ModelShape
from ..table import Table


def layer_table(shape: ModelShape, layer: int) -> Table:
    mlp = common.biased_moe_entries(shape) if shape.is_moe(layer) else common.mlp_entries()
    return {**common.attention_entries(shape), **common.norm_entries(), **mlp}


def model_table(shape: ModelShape) -> Table:
    return common.model_table(shape)
