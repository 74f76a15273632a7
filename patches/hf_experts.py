"""Hugging Face integration: :func:`moe_experts` as a transformers experts implementation.

transformers (5.x) decorates experts modules (``Qwen3MoeExperts``, ``Qwen3_5MoeExperts``,
``Qwen3NextExperts``, ``MixtralExperts``, ...) with ``use_experts_implementation``; their
``forward`` looks ``config._experts_implementation`` up in
``transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS`` and calls
``fn(module, hidden_states, top_k_index, top_k_weights)``. Model construction validates the
name against that registry, so register *before* building or loading the model::

    from twinkle_patches.hf_experts import register_hf_experts, unregister_hf_experts
    register_hf_experts()                       # adds "twinkle"
    model = AutoModelForCausalLM.from_config(cfg, experts_implementation="twinkle")
    ...
    unregister_hf_experts()                     # the registry is exactly as before

Nothing is registered at import time. Modules this kernel does not cover (biases,
transposed or interleaved weights, a post-expert norm, an activation other than SiLU / GELU
(``twinkle_patches._glu.glu_activation``) or custom gating, expert
parallel sentinels) are served by transformers' own ``grouped_mm`` implementation.
"""
from __future__ import annotations

from typing import Callable, Dict, Tuple

import torch

from twinkle_kernels import moe_experts
from twinkle_kernels.patching import Patcher

from ._glu import glu_activation

__all__ = ["register_hf_experts", "unregister_hf_experts", "twinkle_experts_forward"]

# name -> the registry change made for it (its previous entry, or none), kept until unregister.
_SAVED: Dict[str, Patcher] = {}


def _registry():
    from transformers.integrations import moe as hf_moe

    return hf_moe.ExpertsInterface._global_mapping


# (module attribute, the value this kernel covers, which is also the default when absent, why not)
_LAYOUT_FLAGS = (
    ("has_gate", True, "no gate (up_proj only)"),
    ("has_bias", False, "expert biases"),
    ("is_transposed", False, "transposed expert weights"),
    ("is_concatenated", True, "interleaved gate/up layout"),
    ("has_post_expert_norm", False, "post-expert norm"),
    ("_is_expert_parallel", False, "expert-parallel sentinels"),
)


def _unsupported_reason(module: torch.nn.Module) -> str:
    from transformers.integrations import moe as hf_moe

    for attr, covered, why in _LAYOUT_FLAGS:
        if bool(getattr(module, attr, covered)) is not covered:
            return why
    if getattr(type(module), "_apply_gate", hf_moe._default_apply_gate) is not hf_moe._default_apply_gate:
        return "custom gating"
    why = glu_activation(getattr(module, "act_fn", None))[1]
    return why or ""


def twinkle_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers experts-function signature: ``(module, [T, H], [T, k], [T, k]) -> [T, H]``."""
    if _unsupported_reason(self):
        from transformers.integrations.moe import grouped_mm_experts_forward

        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    w = self.gate_up_proj
    # Under autocast the activations may arrive in another dtype than the weights (as in
    # transformers' grouped_mm path): compute in the weights' dtype, return the caller's.
    out = moe_experts(hidden_states.to(w.dtype), top_k_index, top_k_weights, w, self.down_proj,
                      activation=glu_activation(self.act_fn)[0])
    return out.to(hidden_states.dtype)


def register_hf_experts(name: str = "twinkle") -> Callable:
    """Register :func:`twinkle_experts_forward` as experts implementation ``name``.

    Idempotent: registering the same name again keeps the original saved state, so one
    :func:`unregister_hf_experts` restores it. Returns the registered function.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    if name == "eager":
        raise ValueError("name='eager' is reserved by transformers for the modules' own forward")
    mapping = _registry()
    if name in _SAVED:
        mapping[name] = twinkle_experts_forward
    else:
        _SAVED[name] = Patcher()
        _SAVED[name].setitem(mapping, name, twinkle_experts_forward)
    return twinkle_experts_forward


def unregister_hf_experts(name: str = "twinkle") -> bool:
    """Undo :func:`register_hf_experts` for ``name``; returns False if it was not registered by us."""
    if name not in _SAVED:
        return False
    _SAVED.pop(name).undo()
    return True


def registered_names() -> Tuple[str, ...]:
    """Names this module currently holds registered (for reports and the patch registry)."""
    return tuple(_SAVED)
