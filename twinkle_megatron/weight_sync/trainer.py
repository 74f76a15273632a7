"""The trainer side of a sync, on every trainer rank: which streams make this step's version.

- no adapter: the full weights, every sync;
- an adapter, ``merge_lora=False``: the base weights and the adapter on the first sync (two
  parts of one version), the adapter alone afterwards (the base is frozen); the receiver applies
  both to its peft model;
- ``merge_lora=True``: the full weights with the adapter merged, every sync (for a sampler
  without LoRA support).

Example (trainer rank 0 sends to a sampler process; every trainer rank calls ``send()``)::

    sender = None
    if torch.distributed.get_rank() == 0:
        group = weight_sync.connect(rank=0, world_size=2, port=port)
        sender = weight_sync.WeightSender(group, dst=1)
    sync = weight_sync.TrainerSync(model, sender, adapter_name="default", dtype=torch.bfloat16)
    for step in ...:
        ...; model.clip_grad_and_step()
        stats = sync.send()          # SyncStats on rank 0, None elsewhere
"""
from __future__ import annotations

from typing import List, Optional

import torch

from .export import RECEIVERS, is_receiver, rank_and_world
from .transport import SyncStats, WeightSender


class TrainerSync:
    """Sends ``model``'s weights as one version per :meth:`send`, on every trainer rank.

    ``sender``: a :class:`WeightSender` on the ranks that receive the stream (``receivers``:
    "rank0", the global rank 0; "replicas", one rank per data-parallel replica, each with its own
    sampler), None on the others, which produce their share of the stream (the gathers are
    collectives) and receive nothing. ``adapter_name`` / ``merge_lora`` / ``dtype``: as
    ``MegatronModel.get_hf_state_dict`` takes them (see the module docstring for what each
    sync sends). Checked here, the same way on every rank."""

    def __init__(self, model, sender: Optional[WeightSender] = None, *, adapter_name: Optional[str] = None,
                 merge_lora: bool = False, dtype: Optional[torch.dtype] = None, receivers: str = "rank0"):
        if receivers not in RECEIVERS or receivers == "all":
            raise ValueError(f"receivers={receivers!r} must be 'rank0' or 'replicas'")
        if sender is not None and not isinstance(sender, WeightSender):
            raise TypeError(f"sender must be a WeightSender or None, got {type(sender).__name__}")
        rank, _ = rank_and_world()
        if sender is not None and not is_receiver(receivers, rank):
            raise ValueError(f"sender given on rank {rank}, which receives nothing with receivers={receivers!r}")
        if merge_lora and adapter_name is None:
            raise ValueError("merge_lora=True needs adapter_name=")
        # validates adapter_name and dtype now, before any sync (a generator: nothing is gathered)
        model.get_hf_state_dict(adapter_name=adapter_name, merge_lora=merge_lora, dtype=dtype, receivers=receivers)
        self.model, self.sender = model, sender
        self.adapter_name, self.merge_lora, self.dtype, self.receivers = adapter_name, merge_lora, dtype, receivers
        self.syncs = 0

    def streams(self, base: Optional[bool] = None) -> List:
        """This sync's streams (the version's parts). ``base``: with an unmerged adapter, send
        the base weights too (default: on the first sync only)."""
        get = self.model.get_hf_state_dict
        kw = dict(dtype=self.dtype, receivers=self.receivers)
        if self.adapter_name is None:
            return [get(**kw)]
        if self.merge_lora:
            return [get(adapter_name=self.adapter_name, merge_lora=True, **kw)]
        if base is None:
            base = self.syncs == 0
        adapter = get(adapter_name=self.adapter_name, **kw)
        return [get(**kw), adapter] if base else [adapter]

    def send(self, base: Optional[bool] = None) -> Optional[SyncStats]:
        """One sync (every trainer rank calls it at the same point); the sender's
        :class:`SyncStats`, None on ranks without a sender."""
        streams = self.streams(base)
        self.syncs += 1
        if self.sender is not None:
            return self.sender.send(*streams)
        for stream in streams:
            for _ in stream:
                pass
        return None
