"""What LoRA cannot adapt in these models (its targets come from the name table)."""
from __future__ import annotations

from .. import common

UNSUPPORTED = common.unsupported(common.MOE_UNSUPPORTED, {
    "mlp.shared_expert_gate": "the shared-expert gate (megatron applies its weight directly)"})
model_linears = common.model_linears
