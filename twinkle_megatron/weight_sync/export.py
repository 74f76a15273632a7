"""A live MegatronModel's weights as a stream of ``(Hugging Face name, tensor)`` pairs.

Built on the checkpoint export (:class:`twinkle_megatron.convert.ExportItem`: the same gather and
the same name table ``save()`` writes with), one megatron parameter at a time:

1. every rank lists the parameters it keeps after the TP / expert-TP gather (TP rank 0 of DP
   replica 0; experts: expert-TP rank 0 of expert-DP replica 0) with their HF names and shapes,
   computed on the meta device, and the lists are exchanged once (names and shapes only);
2. in that global order, the parameter's TP (expert-TP) group gathers it, its keeper turns it
   into HF tensors (merging the adapter's delta into that tensor alone when asked), and each
   tensor goes to the receivers (one broadcast from the keeper for ``receivers="all"``; a
   send to each receiver for ``"rank0"`` and ``"replicas"``). Pipeline stages and expert-parallel ranks thus reach the
   receivers one tensor at a time.

So no rank holds more than its own shards plus one gathered parameter (and its HF split) and the
tensor being received (tests/megatron/test_weight_sync.py measures the peak resident-set growth of a
124 MB model under TP2 and PP2, with a consumer that touches each tensor: 7-57 MB across runs on
a loaded machine, against its largest tensor's 16 MB). A yielded tensor may
share storage with a parameter (one rank, no cast): treat it as read-only. Every rank must
iterate the stream to its end: the gathers and broadcasts are collectives, and a rank that stops
early leaves the others waiting.
"""
from __future__ import annotations

from typing import Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import convert, lora

# who gets the tensors: every rank; the global rank 0; one rank per data-parallel replica (its
# TP / PP / CP rank 0), e.g. one sampler per replica
RECEIVERS = ("all", "rank0", "replicas")


def _check_dtype(dtype) -> Optional[torch.dtype]:
    if dtype is None or isinstance(dtype, torch.dtype):
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(f"dtype={dtype}: the weights can only be cast to a floating dtype")
        return dtype
    raise TypeError(f"dtype must be a torch.dtype or None, got {dtype!r}")


def _adapter(model, adapter_name):
    if adapter_name is None:
        return None
    if not isinstance(adapter_name, str):
        raise TypeError(f"adapter_name must be a string or None, got {type(adapter_name).__name__}")
    if adapter_name not in model.adapters:
        have = ", ".join(repr(n) for n in model.adapters) or "none"
        raise ValueError(f"adapter_name={adapter_name!r}: this model has no such adapter (its adapters: {have})")
    return model.adapters[adapter_name]


def rank_and_world() -> Tuple[int, int]:
    """This process's global rank and the world size; ``(0, 1)`` without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def hf_state_stream(model, adapter_name: Optional[str] = None, merge_lora: bool = False,
                    dtype: Optional[torch.dtype] = None, receivers: str = "all"
                    ) -> Iterator[Tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every HF weight of ``model`` (see the module docstring); what
    :meth:`twinkle_megatron.MegatronModel.get_hf_state_dict` returns. Arguments are checked
    before anything is gathered, the same way on every rank."""
    if receivers not in RECEIVERS:
        raise ValueError(f"receivers={receivers!r} must be one of {RECEIVERS}")
    dtype = _check_dtype(dtype)
    adapter = _adapter(model, adapter_name)
    if merge_lora and adapter is None:
        if len(model.adapters) != 1:
            have = ", ".join(repr(n) for n in model.adapters) or "no adapter"
            raise ValueError(f"merge_lora=True needs adapter_name= (this model has {have})")
        adapter = next(iter(model.adapters.values()))
    return _stream(model, adapter, merge_lora, dtype, receivers)


def is_receiver(receivers: str, rank: int) -> bool:
    """Whether global rank ``rank`` receives the stream under ``receivers`` (one of :data:`RECEIVERS`)."""
    if receivers == "all":
        return True
    if receivers == "rank0":
        return rank == 0
    from megatron.core import parallel_state as ps
    return (ps.get_tensor_model_parallel_rank() == 0 and ps.get_pipeline_model_parallel_rank() == 0
            and ps.get_context_parallel_rank() == 0)


def _stream(model, adapter, merge_lora, dtype, receivers):
    rank, world = rank_and_world()
    receive = is_receiver(receivers, rank)
    if adapter is not None and not merge_lora:
        yield from _adapter_stream(adapter, dtype, receive, receivers, world)
        return
    merge = lora.MergedDeltas(adapter, lora.full_weights(adapter)) if merge_lora else None
    items = {item.key: item for item in convert.export_items(model.unwrapped_chunks(), model.shape)}
    mine = [(item.key, list(zip(item.names, item.hf_shapes(model.shape))))
            for item in items.values() if item.owner]
    plan: List = [(mine, receive)]
    if world > 1:
        plan = [None] * world
        dist.all_gather_object(plan, (mine, receive))
    to = [r for r, (_, rcv) in enumerate(plan) if rcv]
    for owner, (listed, _) in enumerate(plan):
        for key, hf in listed:
            tensors = None
            item = items.get(key)
            if item is not None and owner in _group_ranks(item):
                tensors = item.gather(model.shape, model.dtype)   # collective over the item's group
            if rank != owner:
                tensors = None
            for i, (name, shape) in enumerate(hf):
                t = None
                if tensors is not None:
                    t = tensors[i]
                    tensors[i] = None   # hold each tensor only until it is sent
                    if merge is not None:
                        t = merge.merge(name, t)
                    if dtype is not None:
                        t = t.to(dtype)
                t = _deliver(t, shape, dtype or model.dtype, owner, rank, world, receivers, to)
                if t is not None and receive:
                    yield name, t
                t = None


def _group_ranks(item) -> List[int]:
    if item.size == 1:
        return [dist.get_rank()] if dist.is_initialized() else [0]
    return dist.get_process_group_ranks(item.group)


def _deliver(t, shape, dtype, owner, rank, world, receivers, to):
    """``t`` (on ``owner``) on the receiving ranks ``to``; None elsewhere."""
    if world == 1:
        return t
    if receivers == "all":
        buf = t.contiguous() if rank == owner else torch.empty(shape, dtype=dtype)
        dist.broadcast(buf, src=owner)
        return buf
    if rank == owner:
        t = t.contiguous()
        for dst in to:
            if dst != owner:
                dist.send(t, dst=dst)
        return t if rank in to else None
    if rank in to:
        buf = torch.empty(shape, dtype=dtype)
        dist.recv(buf, src=owner)
        return buf
    return None


def _adapter_stream(adapter, dtype, receive, receivers, world):
    """The adapter alone, in PEFT's saved key names and layout (what ``save(adapter_name=...)``
    writes). Its factors are gathered over each TP (expert-TP) group; with ``receivers="all"``
    every rank then gets the whole adapter (like its save), otherwise only the receiving ranks
    do and the others hold just their own gathered part, until it is sent."""
    if receivers == "all" or world == 1:
        full = lora.full_weights(adapter)
    else:
        full = _adapter_to_receivers(adapter, receive, world)
    if not receive:
        return
    for name, t in lora.peft_state_dict(full, adapter.parameters).items():
        yield name, t.to(dtype) if dtype is not None else t


def _adapter_to_receivers(adapter, receive: bool, world: int):
    """:func:`lora.full_weights` delivered to the receiving ranks only (a ``gather_object`` to each
    of them; None elsewhere)."""
    from megatron.core import parallel_state as ps
    from ..lora import linear as lora_linear
    mine = {}
    for m in adapter.modules:
        group = m.group if m.expert else ps.get_tensor_model_parallel_group()
        part = lora_linear.gather_full(m, group)
        first = (ps.get_expert_tensor_parallel_rank() if m.expert else ps.get_tensor_model_parallel_rank()) == 0
        if first:
            mine.update(part)
        part = None
    flags = [None] * world
    dist.all_gather_object(flags, receive)
    rank, full = dist.get_rank(), None
    for dst in (r for r, flag in enumerate(flags) if flag):
        parts = [None] * world if rank == dst else None
        dist.gather_object(mine, parts, dst=dst)
        if rank == dst:
            full = {}
            for part in parts:
                full.update(part)
    mine = None
    if full is not None:
        missing = (set(adapter.targets) | set(lora.expert_keys(adapter))) - set(full)
        if missing:
            raise RuntimeError(f"adapter weights missing after the gather: {sorted(missing)[:4]}")
    return full
