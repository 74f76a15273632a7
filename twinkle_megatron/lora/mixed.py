"""The LoRA side of mixed batches (several adapters' rows in one pass of the base model; the
schedule side is :mod:`twinkle_megatron.training.call`, a call with one group per adapter): the
adapter names checked, and in every
adapted linear one forward hook (:class:`MixedRun`) that adds all adapters' deltas at once as
grouped work (:mod:`.grouped`). Every token carries its row's adapter index, laid out as megatron
sees the tokens: ``[1, B]`` for plain rows (sequence and context parallelism split the other
axis), ``[T, 1]`` for a packed THD row (sliced to this rank's sequence shard under SP).

Adapters on routed experts: the index follows the tokens through megatron's token dispatcher
into the experts, whose deltas run grouped over (expert, adapter) segments (:mod:`.mixed_experts`).
Under activation recompute each chunk's output restores its micro-batch's index in the backward
(:meth:`MixedRun.restore_on_backward`), so a recomputed layer reads its own micro-batch's index.
"""
from __future__ import annotations

import functools
from typing import List, Sequence

import torch

from . import grouped, linear, mixed_experts, tenants


def check_names(adapters, trainable, adapter_names, rows: int) -> List[str]:
    """``adapter_names`` checked against ``adapters`` (name -> adapter), ``trainable`` (the names
    with an optimizer) and the batch's ``rows``."""
    if isinstance(adapter_names, str) or not isinstance(adapter_names, Sequence):
        raise TypeError(f"adapter_names must be a list of adapter names (one per row), got "
                        f"{type(adapter_names).__name__}")
    names = list(adapter_names)
    if len(names) != rows:
        raise ValueError(f"adapter_names has {len(names)} names, the batch has {rows} rows (one name per row)")
    for i, n in enumerate(names):
        if n not in adapters:
            have = ", ".join(f"adapter {a!r}" for a in adapters) or "no adapter"
            raise ValueError(f"adapter_names[{i}]={n!r}: this model has {have}")
        if n not in trainable:
            raise ValueError(f"adapter_names[{i}]={n!r} has no optimizer: call set_optimizer(..., "
                             f"adapter_name={n!r}) before forward_backward")
    return names


class MixedRun:
    """One mixed call: the grouped-delta hooks on every adapted linear (``names``: the adapters of
    the call, in group order) and the token groups of the micro-batch running now (``groups``).

    What depends only on the micro-batch and on which of the call's adapters a layer carries (the
    tokens' layer-local adapter index, their order by adapter and segment ends, their scaling) is
    computed once per micro-batch and shared by every layer with the same adapters."""

    def __init__(self, model, names: List[str]):
        self.names, self.handles, self._groups, self._cache = names, [], None, {}
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.moe.moe_layer import MoELayer
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.experts = []
        if any(model.adapters[n].parameters for n in names):
            mixed_experts.check_config(model.config, len(names), model.dtype)
        kinds = {}
        for chunk in model.unwrapped_chunks():
            for base in chunk.modules():
                if isinstance(base, MoELayer) and _carries(base, names):
                    self.experts.append(mixed_experts.ExpertRun(self, base, names))
                slots = base._modules.get("lora")
                if not isinstance(slots, torch.nn.ModuleDict):
                    continue
                present = tuple(n for n in names if n in slots and not slots[n].expert)
                if not present:
                    continue
                if present not in kinds:
                    # the call's group index -> this layer's adapter index (-1: not on this layer);
                    # one entry more, so that -1 maps to -1
                    remap = torch.full((len(names) + 1,), -1, dtype=torch.long)
                    for i, n in enumerate(names):
                        if n in present:
                            remap[i] = present.index(n)
                    kinds[present] = remap.to(model.device)
                modules = [slots[n] for n in present]
                factors = grouped.Factors(lambda ms=modules: [m.factors() for m in ms],
                                          [p for m in modules for p in m.parameters()],
                                          [m.scaling for m in modules], stacked=linear.stacked_factors(modules))
                self.handles.append(base.register_forward_hook(
                    functools.partial(self._hook, modules, present, kinds[present], factors), with_kwargs=True))

    @property
    def groups(self):
        return self._groups

    @groups.setter
    def groups(self, value):
        """The call's adapter index of the tokens of the micro-batch about to run forward."""
        self._groups, self._cache = value, {}

    def restore_on_backward(self, output: torch.Tensor) -> torch.Tensor:
        """``output`` (a chunk's output for the micro-batch of :attr:`groups`), through a node whose
        backward makes that micro-batch's index current again: backward reaches it before any
        layer of the chunk, so a layer recomputed there (activation recompute, whose backwards
        the pipeline schedule interleaves with other micro-batches' forwards) reads its own
        micro-batch's index. A copy, not a view: megatron may free pipeline outputs' storage."""
        return _RestoreGroups.apply(output, self, self._groups)

    @staticmethod
    def activate(adapters, names) -> None:
        """Every per-adapter hook off (this run's hooks add the deltas); the parameters of ``names``
        trainable, every other adapter's frozen."""
        for adapter in adapters.values():
            tenants.switch(adapter, enabled=False, trainable=adapter.name in names)

    def remove(self, adapters):
        """Take this run's hooks off and put the adapters back in their state between calls."""
        for h in self.handles:
            h.remove()
        for e in self.experts:
            e.remove()
        self.handles, self.experts = [], []
        tenants.rest(adapters)

    def token_groups(self, rows: int, width: int) -> torch.Tensor:
        """The call's adapter index (-1: none) of ``rows x width`` tokens (a layer input
        ``[rows, width, ...]``; rows = this rank's sequence shard under SP), flattened row-major."""
        key = ("tokens", rows, width)
        if key not in self._cache:
            g = self._groups
            if g.shape[0] == 1:
                g = g.expand(rows, width)
            elif g.shape[0] != rows:    # the sequence shard of this TP rank
                g = g[self.tp_rank * rows:(self.tp_rank + 1) * rows]
            self._cache[key] = g.reshape(-1)
        return self._cache[key]

    def _local(self, present, remap, rows: int, width: int):
        """For ``rows x width`` tokens (a layer input or output ``[rows, width, ...]``; rows = this
        rank's sequence shard under SP), flattened row-major: (layer-local adapter index, (order,
        segment ends) for :mod:`.grouped`)."""
        key = (present, rows, width)
        if key not in self._cache:
            g = remap[self.token_groups(rows, width)]
            self._cache[key] = (g, grouped.sort_by_group(g, len(present)))
        return self._cache[key]

    def _hook(self, modules, present, remap, factors, base, args, kwargs, output):
        x = args[0] if args else kwargs["input_"]
        out, bias = output
        return self.add_deltas(modules, present, remap, factors, x, out), bias

    def add_deltas(self, modules, present, remap, factors, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The base layer's output ``out`` ``[S', B, out]`` plus all of ``modules``' deltas (scaled)
        for its input ``x`` ``[S(/tp), B, in]``; ``factors``: their :class:`.grouped.Factors`."""
        from megatron.core.tensor_parallel import get_cuda_rng_tracker
        first = modules[0]
        s, b = x.shape[0], x.shape[1]
        g_in, seg_in = self._local(present, remap, s, b)
        flat = x.reshape(s * b, -1).to(factors.params[0].dtype)
        p = [m.dropout.p if isinstance(m.dropout, torch.nn.Dropout) else 0.0 for m in modules]
        if first.training and any(p):
            keep = torch.tensor([1.0 - q for q in p] + [1.0], dtype=flat.dtype, device=flat.device)[g_in]
            fork = get_cuda_rng_tracker().fork() if first.sharded_input() else _nothing()
            with fork:   # as nn.Dropout per adapter: zero with prob. p, the rest scaled by 1 / (1 - p)
                mask = torch.rand_like(flat) < keep[:, None]
            flat = torch.where(mask, flat / keep[:, None], torch.zeros_like(flat))
        if first.tp_size == 1:   # no communication between the factors: one permutation for both
            y = grouped.grouped_lora(flat, seg_in, factors, base=out.reshape(s * b, -1))
            return y.view(out.shape)
        h = grouped.grouped_factor(flat, seg_in, factors, "a").view(s, b, -1)
        h = first.communicate(h)
        _, seg_out = self._local(present, remap, h.shape[0], b)
        y = grouped.grouped_factor(h.reshape(-1, h.shape[-1]), seg_out, factors, "b")
        return out + y.view(out.shape).to(out.dtype)


class _RestoreGroups(torch.autograd.Function):
    @staticmethod
    def forward(ctx, output, run, groups):
        ctx.run, ctx.groups = run, groups
        return output.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.run.groups = ctx.groups
        return grad, None, None


def _carries(layer, names) -> bool:
    """Whether the routed experts of MoE ``layer`` carry one of ``names``."""
    local = getattr(layer.experts, "local_experts", None)
    if not local:
        return False
    slots = [local[0].linear_fc1._modules.get("lora"), local[0].linear_fc2._modules.get("lora")]
    return any(s is not None and n in s for s in slots for n in names)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
