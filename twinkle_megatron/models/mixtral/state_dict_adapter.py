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
from ..table import Entry, Table

CHECKPOINT_RENAMES = ((".block_sparse_moe.", ".mlp."),)


def moe_entries() -> Table:
    return {
        "mlp.router.weight": Entry(("mlp.gate.weight",), linear=True),
        "mlp.experts.local_experts.*.linear_fc1.weight": Entry(
            ("mlp.experts.{e}.w1.weight", "mlp.experts.{e}.w3.weight"), "sections", expert=True,
            fused="mlp.experts.gate_up_proj", linear=True),
        "mlp.experts.local_experts.*.linear_fc2.weight": Entry(
            ("mlp.experts.{e}.w2.weight",), "row", expert=True, fused="mlp.experts.down_proj", linear=True),
    }


def layer_table(shape: ModelShape, layer: int) -> Table:
    return {**common.attention_entries(shape), **common.norm_entries(), **moe_entries()}


def model_table(shape: ModelShape) -> Table:
    return common.model_table(shape)
