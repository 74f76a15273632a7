"""The HF <-> megatron name table (see :mod:`twinkle_megatron.models.table`)."""
from __future__ import annotations

from .. import common
from ..shape import ModelShape
from ..table import Table


def layer_table(shape: ModelShape, layer: int) -> Table:
    return {**common.attention_entries(shape), **common.norm_entries(), **common.mlp_entries()}


def model_table(shape: ModelShape) -> Table:
    return common.model_table(shape)
