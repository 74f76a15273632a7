"""Activation recompute in the facade's models: megatron's own (``TransformerConfig.recompute_*``,
set from ``MegatronModel(recompute_granularity=...)`` by :func:`twinkle_megatron.config.recompute_fields`)
and the one thing the facade adds to it, :func:`keep_grad_path`.

What each setting recomputes in the facade's models:

- ``"full"``: megatron's ``TransformerBlock._checkpointed_forward`` reruns whole layers in the
  backward, whatever modules they hold: the twinkle attention (fused rotary, SDPA), MLP, experts
  and norms, and the Gated DeltaNet layers of the Qwen3.5 hybrid (conv, delta rule, gated norm).
- ``"selective"`` with ``core_attn``: the softmax attention of the attention layers (megatron's
  ``SelfAttention._checkpointed_attention_forward``); with ``use_twinkle_kernels`` the rerun is
  the twinkle one (fused rotary, then SDPA), as ``TwinkleSelfAttention`` hands the rotary to each
  call of the checkpointed function. Gated DeltaNet layers have no core attention in megatron:
  selective recompute keeps their delta rule's activations (only full recompute reruns it).
- ``"selective"`` with ``mlp`` / ``moe`` / ``shared_experts``: the dense MLP, the MoE layer or the
  shared expert of every layer, twinkle modules included (megatron checkpoints the module call).

Recompute changes no result (the RNG states are restored for the rerun; on CPU through the
compatibility layer's CPU generator): only dropout would differ, and the facade's models have none.
"""
from __future__ import annotations

from typing import List

import torch


def _input_requires_grad(module, args, output):
    if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and not output.requires_grad:
        return output.detach().requires_grad_(True)
    return output


def keep_grad_path(chunks: List[torch.nn.Module], config) -> None:
    """With recompute on, make the embedding output of ``chunks`` (GPTModel chunks) require grad.

    megatron's checkpoint functions are reentrant autograd Functions: a checkpointed segment
    whose inputs need no grad returns an output that needs none, so the backward never reruns
    it and the trainable parameters inside get no gradient. That is the case of LoRA (or any
    frozen embedding): the first layers' input comes from a frozen embedding, and without this
    the adapters of the recomputed layers would silently stay at zero grad. Later pipeline
    stages receive inputs that require grad already."""
    if config.recompute_granularity is None:
        return
    for chunk in chunks:
        embedding = getattr(chunk, "embedding", None)
        if embedding is not None and not getattr(embedding, "_twinkle_keeps_grad_path", False):
            embedding.register_forward_hook(_input_requires_grad)
            embedding._twinkle_keeps_grad_path = True
