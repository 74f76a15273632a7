"""GLM-4.5 / GLM-4.6 MoE configs (transformers' ``Glm4MoeConfig``).

Routing (``Glm4MoeTopkRouter``): ``sigmoid(logits)`` scores; experts chosen by ``scores +
e_score_correction_bias`` within the ``topk_group`` of ``n_group`` groups whose two best biased
scores sum highest; weights the unbiased scores of the chosen experts, renormalised
(``norm_topk_prob``) and times ``routed_scaling_factor``. That is megatron's sigmoid router with
``moe_router_enable_expert_bias`` (its group score sums the best ``topk / group_topk``, so the
two agree when that is 2 or there is one group). The multi-token-prediction layers of the
checkpoints (``num_nextn_predict_layers``) are not built, as transformers does not build them.
"""
from __future__ import annotations

from .. import common
from ..shape import ModelShape

MODEL_TYPES = ("glm4_moe",)


def routing_fields(cfg: dict, model_type: str) -> dict:
    """The :class:`ModelShape` fields of DeepSeek-V3-style routing, checked against what
    megatron's router computes."""
    if not cfg.get("norm_topk_prob", True):
        raise ValueError(f"{model_type} with norm_topk_prob=False is not supported (megatron's sigmoid "
                         "router always renormalises its top-k weights)")
    groups, group_topk = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    topk, experts = cfg["num_experts_per_tok"], cfg["n_routed_experts"]
    if groups > 1 and (experts % groups or topk % group_topk or topk // group_topk != 2):
        raise ValueError(f"{model_type}: n_group={groups}, topk_group={group_topk} with num_experts_per_tok="
                         f"{topk} is not supported (transformers scores a group by its 2 best experts, "
                         "megatron by its num_experts_per_tok / topk_group best: they must be 2)")
    return dict(num_experts=experts, moe_intermediate_size=cfg["moe_intermediate_size"], moe_topk=topk,
                norm_topk_prob=True, router_score_function="sigmoid", router_expert_bias=True,
                router_num_groups=groups if groups > 1 else 0, router_group_topk=group_topk if groups > 1 else 0,
                routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                first_k_dense=int(cfg.get("first_k_dense_replace", 0)),
                shared_expert_intermediate_size=cfg["moe_intermediate_size"] * int(cfg.get("n_shared_experts") or 0),
                shared_expert_gated=False)


def model_shape(cfg: dict) -> ModelShape:
    model_type = cfg["model_type"]
    rope, rope_theta = common.rope_parameters(cfg)
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={cfg.get('hidden_act')!r} is not supported (silu)")
    fields = common.shape_fields(cfg, model_type, rope_theta)
    fields.update(routing_fields(cfg, model_type),
                  # transformers' Glm4MoeConfig defaults it to 0.5
                  partial_rotary_factor=float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5))))
    return ModelShape(**fields, qk_norm=bool(cfg.get("use_qk_norm", False)))


def transformer_fields(shape: ModelShape) -> dict:
    return common.moe_transformer_fields(shape)
