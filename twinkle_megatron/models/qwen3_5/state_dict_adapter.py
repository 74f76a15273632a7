"""The HF <-> megatron name table (see :mod:`twinkle_megatron.models.table`).

Gated attention: megatron's ``linear_qkv`` rows per query group are ``[q heads, gate heads, k, v]``;
HF's ``q_proj`` interleaves ``[q_h, gate_h]`` per head (layout ``gated_qkv``). Gated DeltaNet (the
``self_attention`` of a linear-attention layer): each TP rank's ``in_proj`` is
``[q, k, v, z, beta, alpha]`` of its heads (HF: ``in_proj_qkv`` = ``[q; k; v]``, ``in_proj_z``,
``in_proj_b``, ``in_proj_a``), ``conv1d`` channels ``[q, k, v]`` likewise; ``A_log`` / ``dt_bias``
split by value head.
"""
from __future__ import annotations

from .. import common
from ..shape import ModelShape
from ..table import Entry, Table


def gated_delta_net_entries(shape: ModelShape) -> Table:
    qk = shape.linear_key_head_dim * shape.linear_num_key_heads
    v = shape.linear_value_head_dim * shape.linear_num_value_heads
    hv = shape.linear_num_value_heads
    a = "linear_attn."
    return {
        "self_attention.in_proj.weight": Entry(
            tuple(f"{a}in_proj_{x}.weight" for x in ("qkv", "z", "b", "a")), "sections",
            splits=((qk, qk, v), (v,), (hv,), (hv,)), linear=True),
        "self_attention.conv1d.weight": Entry((a + "conv1d.weight",), "sections", splits=((qk, qk, v),)),
        "self_attention.A_log": Entry((a + "A_log",), "column"),
        "self_attention.dt_bias": Entry((a + "dt_bias",), "column"),
        "self_attention.out_norm.weight": Entry((a + "norm.weight",)),
        "self_attention.out_proj.weight": Entry((a + "out_proj.weight",), "row", linear=True),
    }


def shared_expert_entries() -> Table:
    return {**common.mlp_entries("mlp.shared_experts.", "mlp.shared_expert."),
            "mlp.shared_experts.gate_weight": Entry(("mlp.shared_expert_gate.weight",), linear=True)}


def layer_table(shape: ModelShape, layer: int) -> Table:
    if shape.is_linear(layer):
        attention = gated_delta_net_entries(shape)
    else:
        attention = common.attention_entries(shape, gated=True)
    if shape.num_experts:
        mlp = {**common.moe_entries(), **(shared_expert_entries() if shape.shared_expert_intermediate_size else {})}
    else:
        mlp = common.mlp_entries()
    return {**attention, **common.norm_entries(), **mlp}


def model_table(shape: ModelShape) -> Table:
    return common.model_table(shape)
