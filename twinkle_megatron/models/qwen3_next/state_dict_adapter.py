"""The HF <-> megatron name table (see :mod:`twinkle_megatron.models.table`): Qwen3.5-MoE's, except
the Gated DeltaNet input projection. megatron's ``in_proj`` is ``[q, k, v, z, beta, alpha]`` per TP
rank as in Qwen3.5; HF's ``in_proj_qkvz`` holds ``[q_g (dk), k_g (dk), v_g (r dv), z_g (r dv)]``
and ``in_proj_ba`` ``[b_g (r), a_g (r)]`` for each key head g (r value heads per key head, value
head ``g r + i``), read as sections grouped by key head."""
from __future__ import annotations

from .. import common
from ..qwen3_5 import state_dict_adapter as qwen3_5
from ..shape import ModelShape
from ..table import Entry, Table
from .config import is_moe


def gated_delta_net_entries(shape: ModelShape) -> Table:
    dk, dv = shape.linear_key_head_dim, shape.linear_value_head_dim
    r = shape.linear_num_value_heads // shape.linear_num_key_heads
    a = "linear_attn."
    return {**qwen3_5.gated_delta_net_entries(shape),
            "self_attention.in_proj.weight": Entry(
                (a + "in_proj_qkvz.weight", a + "in_proj_ba.weight"), "sections",
                splits=((dk, dk, r * dv, r * dv), (r, r)), groups=shape.linear_num_key_heads, linear=True)}


def layer_table(shape: ModelShape, layer: int) -> Table:
    if shape.is_linear(layer):
        attention = gated_delta_net_entries(shape)
    else:
        attention = common.attention_entries(shape, gated=True)
    if is_moe(shape, layer):
        mlp = {**common.moe_entries(),
               **(qwen3_5.shared_expert_entries() if shape.shared_expert_intermediate_size else {})}
    else:
        mlp = common.mlp_entries()
    return {**attention, **common.norm_entries(), **mlp}


def model_table(shape: ModelShape) -> Table:
    return common.model_table(shape)
