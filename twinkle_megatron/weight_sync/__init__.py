"""Weight sync for RL: a live model's weights, one Hugging Face tensor at a time, into a sampler.

- :func:`hf_state_stream` (what ``MegatronModel.get_hf_state_dict`` returns): ``(name, tensor)``
  pairs in transformers' checkpoint names and shapes, exactly what ``save()`` writes (full,
  ``merge_lora=True`` merged, or one adapter in PEFT's names), gathered per tensor
  (:mod:`.export`);
- :func:`load_hf_weights`: that stream copied in place into a transformers or peft model
  (:mod:`.load`); vLLM's ``model.load_weights`` takes the same stream.

Example (every rank iterates the stream; here one process)::

    from twinkle_megatron.weight_sync import load_hf_weights
    load_hf_weights(hf_model, model.get_hf_state_dict())
"""
from __future__ import annotations

from .export import RECEIVERS, hf_state_stream
from .load import load_hf_weights
from .sampler import HFSampler, sync

__all__ = ["HFSampler", "RECEIVERS", "hf_state_stream", "load_hf_weights", "sync"]
