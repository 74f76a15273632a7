"""What LoRA cannot adapt in these models (its targets come from the name table)."""
from __future__ import annotations

from ..qwen3_5 import lora as qwen3_5

UNSUPPORTED = qwen3_5.UNSUPPORTED
model_linears = qwen3_5.model_linears
