"""The HF <-> megatron name table (see :mod:`twinkle_megatron.models.table`).

transformers names Mixtral's router ``mlp.gate`` and its experts ``mlp.experts`` (fused
``gate_up_proj`` / ``down_proj``); checkpoints on disk keep the original per-expert names under
``block_sparse_moe.experts.{e}.w1`` (gate), ``w3`` (up), ``w2`` (down). The table uses the
per-expert ``w*`` names under ``mlp.`` (transformers loads them), and reads ``block_sparse_moe.``
checkpoints through :data:`CHECKPOINT_RENAMES`.
"""
from __future__ import annotations

from .. import common
from ..shape import ModelShape
from ..table import Table

CHECKPOINT_RENAMES = ((".block_sparse_moe.", ".mlp."),)


def moe_entries() -> Table:
    """The router and experts as :func:`common.moe_entries`, with Mixtral's expert names."""
    return common.moe_entries(gate="w1", up="w3", down="w2")


def layer_table(shape: ModelShape, layer: int) -> Table:
    return {**common.attention_entries(shape), **common.norm_entries(), **moe_entries()}


def model_table(shape: ModelShape) -> Table:
    return common.model_table(shape)
