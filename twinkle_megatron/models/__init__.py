"""Model families, one folder each with the same files, and the one registry of them.

Every family folder (``llama/``: Llama, Qwen2, Qwen3; ``qwen3_moe/``: Qwen3-MoE; ``qwen3_5/``: the
Qwen3.5 hybrid, dense or MoE; ``mixtral/``; ``glm4_moe/``: GLM-4.5 / 4.6 MoE; ``deepseek_v3/``; ``qwen3_next/``) holds everything that differs between families:

- ``config.py``: its ``model_type`` values, the HF config -> :class:`ModelShape` translation and its
  megatron ``TransformerConfig`` fields;
- ``spec.py``: which layer spec each layer gets (built by :mod:`twinkle_megatron.spec`);
- ``state_dict_adapter.py``: the one HF <-> megatron name table (:mod:`.table`); the converter
  exports through the same table it imports with;
- ``lora.py``: what LoRA cannot adapt there (its targets come from the name table);
- ``__init__.py``: its :class:`Family`.

The layers above (:mod:`twinkle_megatron.config`, ``convert``, ``lora``, ``model``) ask
:func:`family` and never branch on a model type. Adding a family is one folder and one line in
:data:`FAMILIES`.
"""
from __future__ import annotations

from typing import Tuple

from . import deepseek_v3, glm4_moe, llama, mixtral, qwen3_5, qwen3_moe, qwen3_next
from .family import Family
from .shape import ModelShape  # noqa: F401 (re-exported)

FAMILIES: Tuple[Family, ...] = (
    llama.FAMILY,
    qwen3_moe.FAMILY,
    qwen3_5.FAMILY,
    mixtral.FAMILY,
    glm4_moe.FAMILY,
    deepseek_v3.FAMILY,
    qwen3_next.FAMILY,
)

MODEL_TYPES = tuple(t for f in FAMILIES for t in f.model_types)
_BY_TYPE = {t: f for f in FAMILIES for t in f.model_types}


def family(model_type) -> Family:
    """The family that reads HF ``model_type``; ValueError naming it (and the supported ones) if none."""
    if not isinstance(model_type, str) or model_type not in _BY_TYPE:
        raise ValueError(f"model_type={model_type!r} is not supported; supported: {MODEL_TYPES}")
    return _BY_TYPE[model_type]
