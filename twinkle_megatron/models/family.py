"""``Family``: what a model family folder gives the layers above it (see :mod:`twinkle_megatron.models`)."""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Tuple

from .shape import ModelShape
from .table import Table


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family: the HF ``model_type`` values it reads and its family-specific pieces.

    - ``model_shape(hf_config) -> ModelShape``: config translation (``config.py``);
    - ``transformer_fields(shape) -> dict``: megatron ``TransformerConfig`` fields beyond the shared
      ones (``config.py``);
    - ``layer_specs(shape, backend) -> [spec per global layer]`` (``spec.py``);
    - ``layer_table(shape, layer)`` / ``model_table(shape)``: the one HF <-> megatron name table
      (``state_dict_adapter.py``; see :mod:`twinkle_megatron.models.table`);
    - ``lora_unsupported``: HF module suffixes LoRA cannot adapt -> why; ``model_linears(shape)``:
      the linear-like HF modules outside the layers, (before, after) them (``lora.py``);
    - ``checkpoint_renames``: ``(old, new)`` substrings of checkpoint names on disk that the table
      names otherwise (older layouts transformers still loads), applied when reading.
    """
    name: str
    model_types: Tuple[str, ...]
    model_shape: Callable[[dict], ModelShape]
    transformer_fields: Callable[[ModelShape], dict]
    layer_specs: Callable[..., List]
    layer_table: Callable[[ModelShape, int], Table]
    model_table: Callable[[ModelShape], Table]
    lora_unsupported: Dict[str, str]
    model_linears: Callable[[ModelShape], Tuple[List[str], List[str]]]
    checkpoint_renames: Tuple[Tuple[str, str], ...] = ()
