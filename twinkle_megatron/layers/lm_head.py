"""The LM head fused with the loss on the last pipeline stage: per-token log-probs and entropy from
the final hidden states and the output-layer weight shard, without the [tokens, V / tp] logits.

- :func:`gpt_model_class`: megatron's ``GPTModel`` whose forward takes
  ``return_hidden_states=True``: the last stage then returns the decoder's output (after the final
  norm) instead of running ``output_layer``. Without it, the model is megatron's unchanged.
- :func:`output_head`: the weight ``output_layer`` would use: its own, or with tied embeddings
  what ``shared_embedding_or_output_weight()`` gives (the embedding on a one-stage pipeline, the
  last stage's copy otherwise, whose grad megatron all-reduces with the first stage's).
- :func:`fused_token_logps`: ``(logps, entropy)`` through
  ``twinkle_kernels.fused_linear_cross_entropy`` (one TP rank) or its vocab-parallel form (the
  statistics reduced over the TP group; under sequence parallelism it gathers the sequence as
  ``output_layer`` would, and reduce-scatters the hidden gradient).
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Tuple

import torch

import twinkle_kernels as tk


@functools.lru_cache(maxsize=None)
def gpt_model_class() -> type:
    from megatron.core.models.gpt import GPTModel

    class TwinkleGPTModel(GPTModel):
        """GPTModel with ``forward(..., return_hidden_states=False)``: True makes the last stage
        return the final hidden states ``[s, b, h]`` (sequence-first; this rank's ``s / tp`` under
        sequence parallelism, its CP share under context parallelism) instead of the logits."""

        _return_hidden_states = False

        def forward(self, *args, return_hidden_states: bool = False, **kwargs):
            # a per-call switch read by _postprocess below (megatron's forward passes no extra
            # argument through to it)
            self._return_hidden_states = bool(return_hidden_states)
            try:
                return super().forward(*args, **kwargs)
            finally:
                self._return_hidden_states = False

        def _postprocess(self, hidden_states, *args, **kwargs):
            if self._return_hidden_states and self.post_process:
                if self.mtp_process or self.config.mtp_num_layers is not None:
                    raise NotImplementedError("return_hidden_states with multi-token prediction")
                return hidden_states
            return super()._postprocess(hidden_states, *args, **kwargs)

    return TwinkleGPTModel


class OutputHead(NamedTuple):
    """What :func:`fused_token_logps` needs of a last-stage GPTModel's output layer."""
    weight: torch.Tensor            # [V / tp, H]
    bias: Optional[torch.Tensor]    # [V / tp] or None
    sequence_parallel: bool


def output_head(model) -> OutputHead:
    """The weight and bias a last-stage GPTModel's ``_postprocess`` gives ``output_layer``."""
    if model.share_embeddings_and_output_weights:
        weight = model.shared_embedding_or_output_weight()
    else:
        weight = model.output_layer.weight
    return OutputHead(weight, model.output_layer.bias, bool(model.output_layer.sequence_parallel))


def fused_token_logps(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *,
                      bias: Optional[torch.Tensor] = None, temperature: float = 1.0,
                      with_entropy: bool = False, tp_group=None, sequence_parallel: bool = False
                      ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Per-token ``log softmax(hidden @ weight.T / temperature)[target]`` and its entropy.

    hidden: ``[s_local, rows, H]`` megatron's sequence-first final hidden states (any float dtype;
    cast to the weight's, which is exact for the fp32 copy megatron's Float16Module makes of bf16
    / fp16 outputs); ``s_local = s / tp`` with ``sequence_parallel``. weight: ``[V / tp, H]`` this
    rank's vocabulary shard (``tp_group`` None or of size 1: the whole head). target: ``[rows, s]``
    int global token ids, all valid (clamp ignored positions: their values are returned but
    meaningless). Returns fp32 ``[rows, s]`` tensors (entropy None unless ``with_entropy``),
    differentiable in hidden, weight and bias.
    """
    import torch.distributed as dist
    h = hidden.to(weight.dtype)
    labels = target.t()                      # [s, rows], hidden's (gathered) leading dims
    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    kw = dict(bias=bias, reduction="sum", temperature=temperature, return_logps=True,
              return_entropy=bool(with_entropy))
    if tp == 1:
        out = tk.fused_linear_cross_entropy(h.reshape(-1, h.shape[-1]), weight, labels.reshape(-1), **kw)
    else:
        from twinkle_kernels.linear_ce import vocab_parallel_fused_linear_cross_entropy
        out = vocab_parallel_fused_linear_cross_entropy(h, weight, labels, tp_group,
                                                        sequence_parallel=sequence_parallel, **kw)
    shape = labels.shape
    logps = out[1].reshape(shape).t().contiguous()
    entropy = out[2].reshape(shape).t().contiguous() if with_entropy else None
    return logps, entropy
