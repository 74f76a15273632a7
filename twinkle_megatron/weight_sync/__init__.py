"""Weight sync for RL: a live model's weights, one Hugging Face tensor at a time, into a sampler.

- :func:`hf_state_stream` (what ``MegatronModel.get_hf_state_dict`` returns): ``(name, tensor)``
  pairs in transformers' checkpoint names and shapes, exactly what ``save()`` writes (full,
  ``merge_lora=True`` merged, or one adapter in PEFT's names), gathered per tensor
  (:mod:`.export`);
- :func:`load_hf_weights`: that stream copied in place into a transformers or peft model
  (:mod:`.load`);
- :class:`WeightSender` / :class:`WeightReceiver`: the stream sent to another process in
  buckets over a process group (:func:`connect` makes one between a trainer rank and a sampler
  outside its world), one checked, whole :class:`WeightVersion` per sync (:mod:`.transport`);
- :class:`TrainerSync`: what each sync sends, on every trainer rank (the full weights; with LoRA
  the base once, then the adapter alone; or the adapter merged) (:mod:`.trainer`).

In one process::

    from twinkle_megatron.weight_sync import load_hf_weights
    load_hf_weights(hf_model, model.get_hf_state_dict())

To a sampler process (trainer: every rank calls ``sync.send()`` after each optimizer step)::

    # trainer, every rank of its world
    sender = None
    if torch.distributed.get_rank() == 0:
        sender = WeightSender(connect(rank=0, world_size=2, port=PORT), dst=1)
    sync = TrainerSync(model, sender, adapter_name="default", dtype=torch.bfloat16)
    ...; model.clip_grad_and_step(); sync.send()
    # sampler process
    receiver = WeightReceiver(connect(rank=1, world_size=2, host=TRAINER, port=PORT), src=0)
    for version in receiver:              # one per sync, until the sender's close()
        version.apply(peft_model)         # checked whole, then copied in place

vLLM: its ``model.load_weights(weights)`` takes the same ``(name, tensor)`` pairs and fuses and
shards the names itself; give it ``model.get_hf_state_dict(dtype=...)`` in-process, or
``iter(version)`` for a received version (inside a vLLM worker the model is
``llm.llm_engine.model_executor.driver_worker.model_runner.model``, or reach it through
``collective_rpc``, depending on the vLLM version). Adapter-only versions go to vLLM's LoRA
manager instead (PEFT names), not to ``load_weights``.
"""
from __future__ import annotations

from .export import RECEIVERS, hf_state_stream
from .load import load_hf_weights
from .sampler import HFSampler, sync
from .trainer import TrainerSync
from .transport import SyncStats, WeightReceiver, WeightSender, WeightSyncError, WeightVersion, connect

__all__ = ["HFSampler", "RECEIVERS", "SyncStats", "TrainerSync", "WeightReceiver", "WeightSender", "WeightSyncError", "WeightVersion",
           "connect", "hf_state_stream", "load_hf_weights", "sync"]
