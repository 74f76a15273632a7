"""The HF <-> megatron name table (see :mod:`twinkle_megatron.models.table`).

Multi-latent attention: every projection is a megatron column-parallel linear (rows split over
TP; the down projections' outputs are gathered inside MLA) except ``o_proj``. Rows keep HF's
order: ``kv_a_proj_with_mqa`` is ``[latent; k_rope]`` as megatron splits it, ``q_b_proj`` /
``kv_b_proj`` are head-major (``[nope; rope]`` / ``[k_nope; v]`` per head) as megatron reads them.
"""
from __future__ import annotations

from .. import common
from ..shape import ModelShape
from ..table import Entry, Table


def attention_entries(shape: ModelShape) -> Table:
    a, m = "self_attn.", "self_attention."
    if shape.family_field("q_lora_rank"):
        q = {m + "linear_q_down_proj.weight": Entry((a + "q_a_proj.weight",), "column", linear=True),
             m + "q_layernorm.weight": Entry((a + "q_a_layernorm.weight",)),
             m + "linear_q_up_proj.weight": Entry((a + "q_b_proj.weight",), "column", linear=True)}
    else:
        q = {m + "linear_q_proj.weight": Entry((a + "q_proj.weight",), "column", linear=True)}
    return {**q,
            m + "linear_kv_down_proj.weight": Entry((a + "kv_a_proj_with_mqa.weight",), "column", linear=True),
            m + "kv_layernorm.weight": Entry((a + "kv_a_layernorm.weight",)),
            m + "linear_kv_up_proj.weight": Entry((a + "kv_b_proj.weight",), "column", linear=True),
            m + "linear_proj.weight": Entry((a + "o_proj.weight",), "row", linear=True)}


def layer_table(shape: ModelShape, layer: int) -> Table:
    mlp = common.biased_moe_entries(shape) if shape.is_moe(layer) else common.mlp_entries()
    return {**attention_entries(shape), **common.norm_entries(), **mlp}


def model_table(shape: ModelShape) -> Table:
    return common.model_table(shape)
