"""What LoRA cannot adapt in these models (its targets come from the name table)."""
from __future__ import annotations

from .. import common

UNSUPPORTED = common.unsupported(common.MOE_UNSUPPORTED)
model_linears = common.model_linears
