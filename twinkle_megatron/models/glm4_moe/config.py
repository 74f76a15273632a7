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


def model_shape(cfg: dict) -> ModelShape:
    model_type = cfg["model_type"]
    rope, rope_theta = common.rope_parameters(cfg)
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={cfg.get('hidden_act')!r} is not supported (silu)")
    fields = common.shape_fields(cfg, model_type, rope_theta)
    fields.update(common.routing_fields(cfg, model_type),
                  # transformers' Glm4MoeConfig defaults it to 0.5
                  partial_rotary_factor=float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5))))
    return ModelShape(**fields, qk_norm=bool(cfg.get("use_qk_norm", False)))


def transformer_fields(shape: ModelShape) -> dict:
    return common.moe_transformer_fields(shape)
