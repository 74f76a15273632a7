"""LoRA adapters on a MegatronModel, keyed by name: config checks (:mod:`.config`), Hugging Face
target names (:mod:`.targets`), the LoRA linear layers on megatron's parallel linears
(:mod:`.layers`), building an adapter (:mod:`.adapter`) and peft's saved format (:mod:`.peft_format`).

A model keeps its adapters in ``MegatronModel.adapters`` (``{name: Adapter}``); every base linear
an adapter adapts holds its weights under the child ``lora.<name>`` (parameters
``...linear_qkv.lora.<name>.lora_A.q_proj``), as peft keys ``lora_A[<name>]``. Any number of
adapters, trained time-shared, each with its own training state (:mod:`.tenants`), or several in
one batch (:mod:`.mixed`, with the grouped deltas of :mod:`.grouped`; on routed experts,
:mod:`.mixed_experts`).

Targets are named as peft names them on the transformers model (``model.layers.3.self_attn.q_proj``);
``target_modules`` is matched against those names the way peft matches it (a string is a regex
that must match the whole name; a list entry matches a name equal to it or ending in ``.entry``;
``"all-linear"``: every linear this package supports; what cannot be adapted, and why, is the
family's ``lora_unsupported``). The targets of each megatron linear come from the family's name
table; for the families here, megatron module -> HF targets:

- ``self_attention.linear_qkv``: ``self_attn.q_proj``, ``k_proj``, ``v_proj`` (Qwen3.5: q_proj also
  carries the output gate, interleaved per head as transformers has it);
- ``self_attention.linear_proj``: ``self_attn.o_proj``;
- ``mlp.linear_fc1`` / ``linear_fc2``: ``mlp.gate_proj``, ``up_proj`` / ``down_proj``; the same under
  ``mlp.shared_experts`` for ``mlp.shared_expert.*`` (Qwen3.5-MoE);
- Gated DeltaNet ``self_attention.in_proj`` / ``out_proj``: ``linear_attn.in_proj_qkv``,
  ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` / ``linear_attn.out_proj``.

Routed experts are targeted as peft targets transformers' fused expert parameters: by
``target_parameters`` (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``, matched like a
``target_modules`` list against ``model.layers.N.mlp.experts.<param>``), never by ``target_modules``
(transformers has no per-expert ``gate_proj`` module to name, so peft would not adapt experts for
it either). One adapter per expert: ``gate_up_proj`` -> every local expert's ``linear_fc1`` (gate
and up share it, as the fused parameter does), ``down_proj`` -> ``linear_fc2``. Exported in peft's
ParamWrapper format (:func:`peft_state_dict`); peft refuses ``lora_dropout`` on parameters, and so
does this module.

The per-rank row layout of each fused projection is computed by running the weight converter's
own layout functions on index tensors, so it cannot drift from how the weights are sharded.
"""
from __future__ import annotations

from .adapter import Adapter, add_adapter, parameter_counts
from .config import lora_config, scaling
from .linear import LoraAdapter, LoraTarget, attach
from .peft_format import (MergedDeltas, adapter_config_dict, expert_keys, from_peft_state_dict, full_weights,
                          load_weights, merged_delta, peft_state_dict)
from .targets import hf_expert_parameter_names, hf_linear_names, resolve_parameters, resolve_targets

__all__ = ["Adapter", "LoraAdapter", "LoraTarget", "MergedDeltas", "adapter_config_dict", "add_adapter", "attach",
           "expert_keys",
           "from_peft_state_dict", "full_weights", "hf_expert_parameter_names", "hf_linear_names",
           "load_weights", "lora_config", "merged_delta", "parameter_counts", "peft_state_dict",
           "resolve_parameters", "resolve_targets", "scaling"]
