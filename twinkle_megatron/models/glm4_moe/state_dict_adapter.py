"""The HF <-> megatron name table (see :mod:`twinkle_megatron.models.table`): the router's
score-correction bias is megatron's ``expert_bias`` buffer, the shared expert an ungated MLP."""
from __future__ import annotations

from .. import common
from ..shape import ModelShape
from ..table import Entry, Table


def moe_entries(shape: ModelShape) -> Table:
    """Router (weight and score-correction bias), routed experts and the shared expert."""
    out = {**common.moe_entries(),
           "mlp.router.expert_bias": Entry(("mlp.gate.e_score_correction_bias",))}
    if shape.shared_expert_intermediate_size:
        out.update(common.mlp_entries("mlp.shared_experts.", "mlp.shared_experts."))
    return out


def layer_table(shape: ModelShape, layer: int) -> Table:
    mlp = moe_entries(shape) if shape.is_moe(layer) else common.mlp_entries()
    return {**common.attention_entries(shape), **common.norm_entries(), **mlp}


def model_table(shape: ModelShape) -> Table:
    return common.model_table(shape)
