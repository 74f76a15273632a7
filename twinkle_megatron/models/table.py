"""The vocabulary of a family's Hugging Face <-> megatron name table.

A family gives one table per decoder layer (``layer_table(shape, layer)``) and one for the rest of
the model (``model_table(shape)``): ``{megatron parameter name: Entry}``, in the order the HF
modules come in the transformers model. The weight converter (:mod:`twinkle_megatron.convert`)
reads it in both directions (import and export are the same table), and LoRA
(:mod:`twinkle_megatron.lora`) derives its targets and their row layouts from it.

Layer tables are keyed by the name inside a layer (``self_attention.linear_qkv.weight``) and name
HF tensors inside the layer prefix (``self_attn.q_proj.weight`` under ``model.layers.N.``); routed
experts are keyed with ``*`` for the local expert index
(``mlp.experts.local_experts.*.linear_fc1.weight``) and name HF tensors with ``{e}`` for the global
one. Model tables use full names on both sides.

Layouts (how the HF tensors ``hf`` become one megatron tensor, sharded over tensor parallelism, or
expert-tensor parallelism for ``expert=True``):

- ``replicated``: ``hf[0]`` as is;
- ``column`` / ``row``: ``hf[0]`` split along dim 0 / dim 1;
- ``sections``: every HF tensor cut into ``splits`` (one tuple of row counts per HF tensor; empty:
  every tensor is one section of equal size), each section split along dim 0, and a rank's pieces
  concatenated (megatron's fused ``[gate; up]`` fc1, the Gated DeltaNet ``in_proj`` / ``conv1d``);
  with ``groups`` = G, each HF tensor is G consecutive repeats of its ``splits`` (grouped per head
  group, e.g. Qwen3-Next's ``in_proj_qkvz``: ``[q_g, k_g, v_g, z_g]`` per key head g) and section i
  is the i-th split of every group, in group order;
- ``qkv``: HF ``q, k, v`` grouped per query group (``[q heads of g, k_g, v_g]``), split along dim 0;
- ``gated_qkv``: the same with HF's ``q_proj`` holding ``[q_h, gate_h]`` per head, grouped as
  ``[q heads, gate heads, k, v]``.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Tuple

LAYOUTS = ("replicated", "column", "row", "sections", "qkv", "gated_qkv")
# layouts of a megatron Column/RowParallelLinear weight (what LoRA can attach to)
PARALLEL_LINEAR_LAYOUTS = ("column", "row", "sections", "qkv", "gated_qkv")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One megatron parameter and the HF tensors it is made of.

    ``hf``: the HF tensor names, in the order the layout takes them; ``layout``: see the module
    docstring; ``splits``: ``sections`` only; ``expert``: a routed expert's parameter (``{e}`` in
    ``hf``, sharded over expert-TP); ``fused``: experts only, the HF name of the stacked tensor
    ``[E, ...]`` whose ``[e]`` is the HF tensors concatenated along dim 0 (transformers' fused
    experts: read when the per-expert names are absent; LoRA targets it by parameter);
    ``linear``: the HF tensors are weights of linear modules peft could target; ``export``: False
    when the HF side holds no tensor of its own for it (a tied LM head); ``groups``: ``sections``
    with ``splits`` only, the HF tensors' head groups (0: not grouped)."""
    hf: Tuple[str, ...]
    layout: str = "replicated"
    splits: Tuple[Tuple[int, ...], ...] = ()
    expert: bool = False
    fused: str = ""
    linear: bool = False
    export: bool = True
    groups: int = 0

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r} is not one of {LAYOUTS}")
        if self.splits and len(self.splits) != len(self.hf):
            raise ValueError(f"splits {self.splits} must give one tuple per HF tensor {self.hf}")
        if self.groups and not (self.layout == "sections" and self.splits):
            raise ValueError("groups needs layout='sections' with splits")


Table = Dict[str, Entry]


def module_of(name: str) -> str:
    """The HF module of a parameter name (``self_attn.q_proj.weight`` -> ``self_attn.q_proj``)."""
    return name.rsplit(".", 1)[0]


def linear_modules(table: Table, prefix: str = "") -> List[str]:
    """The HF linear modules of ``table``, in order, under ``prefix``: what peft would see on the
    transformers model (routed experts once, as their fused module)."""
    out: List[str] = []
    for entry in table.values():
        if not entry.linear:
            continue
        names = [module_of(entry.fused)] if entry.expert else [module_of(h) for h in entry.hf]
        for n in names:
            if prefix + n not in out:
                out.append(prefix + n)
    return out


def expert_parameters(table: Table, prefix: str = "") -> List[str]:
    """The fused routed-expert parameters of ``table`` (``mlp.experts.gate_up_proj``, ...) under
    ``prefix``, in the order transformers registers them."""
    return [prefix + e.fused for e in table.values() if e.expert and e.fused]
