"""Per-rank parameter counts from the facade's own sharding rules.

Every megatron parameter is an entry of its family's HF <-> megatron name table
(:mod:`twinkle_megatron.models.table`), the table the weight converter shards with; its size is
the size of the HF tensors it is made of, read from the transformers model built on the meta
device (no memory, no weights). A rank holds:

- ``replicated`` entries whole, the other layouts split over tensor parallelism;
- routed experts: ``num_experts / ep`` experts, each split over expert-tensor parallelism;
- the layers of its pipeline stage (megatron's even split), the embedding on the first stage, the
  final norm and the LM head on the last (with tied embeddings and more than one stage, megatron
  keeps a copy of the embedding as the last stage's LM head);
- with LoRA of rank ``r`` on every linear LoRA can adapt (``target_modules="all-linear"``): per
  target ``A [r, in]`` and ``B [out / tp, r]`` column-parallel, ``A [r, in / tp]`` and ``B [out, r]``
  row-parallel (:mod:`twinkle_megatron.lora.linear`).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List

from .. import convert, models
from ..models.shape import ModelShape
from ..models.table import module_of


@dataclasses.dataclass
class StageParams:
    """Element counts on one rank of pipeline stage ``stage``: ``dense`` (replicated over
    data parallelism: everything but routed experts), ``expert`` (routed experts, sharded over
    expert parallelism), ``lora`` (adapter parameters, when asked for)."""
    stage: int
    layers: List[int]
    dense: int = 0
    expert: int = 0
    lora: int = 0

    @property
    def base(self) -> int:
        return self.dense + self.expert


def hf_shapes(hf_config: dict) -> Dict[str, tuple]:
    """``{HF tensor name: shape}`` of the transformers model for ``hf_config`` (built on the meta device)."""
    import torch
    import transformers
    cfg = transformers.AutoConfig.for_model(**hf_config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def stage_layers(num_layers: int, pp: int) -> List[List[int]]:
    """The global layers of each pipeline stage (megatron's even split)."""
    if num_layers % pp:
        raise ValueError(f"num_layers={num_layers} is not divisible by pp={pp}")
    n = num_layers // pp
    return [list(range(p * n, (p + 1) * n)) for p in range(pp)]


def _numel(shape: tuple) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def _split(numel: int, parts: int, what: str) -> int:
    if numel % parts:
        raise ValueError(f"{what}: {numel} elements do not split over {parts} ranks")
    return numel // parts


def count(shape: ModelShape, shapes: Dict[str, tuple], *, tp: int = 1, pp: int = 1, ep: int = 1,
          etp: int = None, lora_rank: int = 0) -> List[StageParams]:
    """One :class:`StageParams` per pipeline stage for ``shape`` on a (tp, pp, ep, etp) mesh;
    ``shapes``: :func:`hf_shapes` of its config. ``etp`` defaults to 1, as ``DeviceMesh.from_sizes``."""
    etp = 1 if etp is None else etp
    tables = convert.Tables(shape)
    unsupported = tuple(models.family(shape.model_type).lora_unsupported)
    out = []
    for stage, layers in enumerate(stage_layers(shape.num_layers, pp)):
        sp = StageParams(stage, layers)
        first, last = stage == 0, stage == pp - 1
        for name, entry in tables.model.items():
            on = (first and name.startswith("embedding")) or (last and name.startswith("decoder.final")) or \
                (last and name == "output_layer.weight" and (not shape.tie_word_embeddings or pp > 1))
            if on:
                sp.dense += _entry_numel(entry, "", shapes, tp, name)
        for layer in layers:
            prefix = convert.layer_prefix(shape, layer)
            for name, entry in tables.layer(layer).items():
                if entry.expert:
                    local = _split(shape.num_experts, ep, f"num_experts over ep for {name}")
                    sp.expert += local * _split(_expert_numel(entry, prefix, shapes, shape.num_experts), etp,
                                                f"{name} over etp")
                    continue
                sp.dense += _entry_numel(entry, prefix, shapes, tp, name)
                if lora_rank and entry.linear and entry.layout != "replicated" and \
                        not any(module_of(h).endswith(u) for h in entry.hf for u in unsupported):
                    sp.lora += _lora_numel(entry, prefix, shapes, tp, lora_rank)
        out.append(sp)
    return out


def _entry_numel(entry, prefix: str, shapes, tp: int, name: str) -> int:
    numel = sum(_numel(_shape(shapes, prefix + h)) for h in entry.hf)
    return numel if entry.layout == "replicated" else _split(numel, tp, f"{name} over tp")


def _expert_numel(entry, prefix: str, shapes, num_experts: int) -> int:
    names = [prefix + h.format(e=0) for h in entry.hf]
    if all(n in shapes for n in names):
        return sum(_numel(shapes[n]) for n in names)
    return _numel(_shape(shapes, prefix + entry.fused)) // num_experts   # transformers' fused [E, ...]


def _lora_numel(entry, prefix: str, shapes, tp: int, r: int) -> int:
    total = 0
    for h in entry.hf:
        out_f, in_f = _shape(shapes, prefix + h)
        if entry.layout == "row":
            total += r * in_f // tp + out_f * r
        else:
            total += r * in_f + out_f // tp * r
    return total


def _shape(shapes, name: str) -> tuple:
    if name not in shapes:
        raise KeyError(f"the transformers model has no tensor {name!r}")
    return shapes[name]
