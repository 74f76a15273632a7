"""MoE router replay in a call: ``forward_only(return_routed_experts=True)`` records the experts
every token was routed to, ``routed_experts=R`` replays them (``forward_only`` and
``forward_backward``).

The user's layout is ``R`` int [B, S, L_moe, k]: for row b and position t (the token
``input_ids[b, t]``, not shifted like the labels), the k global expert ids of each MoE layer, the
layers in global order (the model's MoE layers counted from the first, whatever pipeline stage or
virtual chunk holds them). Each rank gives (and gets) the rows of its own ``inputs``.

The engine is megatron's ``RouterReplay`` held by every router of the facade
(:mod:`twinkle_megatron.layers.router`): this module sets each router's action and ids per
micro-batch and reads the recorded ids back. Token order: a router sees the hidden states of its
rank, [S_model / tp (SP), rows, H] flattened S-major, where S_model is the micro-batch as the
model gets it (:func:`model_view`: this CP rank's positions; packed rows one THD row, padded for
SP). Replay puts each micro-batch's ``R`` in that order; recording takes the routers' ids back
through the inverse (all-gathered over the TP group under SP, over the CP group under CP, cut
back to rows for packed ones) and, after the schedule, sums each layer's ids into
[B, S, L_moe, k] over the pipeline group (a layer lives on one stage; zeros elsewhere).

Activation recompute reruns a layer's forward in the backward: the output of each chunk goes
through :class:`ReplayOnBackward`, whose backward, which runs before any of the chunk's layers,
switches that chunk's routers to REPLAY_BACKWARD, so a rerun pops the ids of the micro-batches in
forward order, as megatron's schedules run the backwards.

Padding: ``R`` is checked (and used) where ``attention_mask`` is 1 (everywhere without one);
positions with mask 0 and the facade's own SP / CP / packing padding are routed to experts
``0 .. k-1`` (no real token attends to them). Recorded ids at padding positions are the router's
own.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from ..layers.router import router_class

NAME = "routed_experts"


def moe_layers(config) -> List[int]:
    """The 1-based global layer numbers of the MoE layers of a model with ``config`` (megatron's
    ``moe_layer_freq``: an int f, a layer every f, or a 0/1 list per layer), in order."""
    freq = config.moe_layer_freq
    n = config.num_layers
    pattern = [1 if i % freq == 0 else 0 for i in range(n)] if isinstance(freq, int) else list(freq)
    return [i + 1 for i in range(n) if pattern[i]]


def routers(chunk) -> list:
    """The facade's routers of ``chunk`` (a GPTModel chunk), in module order."""
    cls = router_class()
    return [m for m in chunk.modules() if isinstance(m, cls)]


def check(value, batch: Dict[str, torch.Tensor], *, num_experts: int, num_layers: int, topk: int) -> torch.Tensor:
    """``routed_experts`` checked against ``batch`` (this rank's [B, S] tensors) -> int64
    [B, S, L_moe, k] (CPU), with ids ``0 .. k-1`` where ``attention_mask`` is 0. ValueError
    naming ``routed_experts`` for a model without MoE layers, a non-integer tensor, a shape other
    than [B, S, num_layers, topk], an id outside [0, num_experts) or the same id twice among one
    token's k (at the positions the mask keeps)."""
    if not num_experts:
        raise ValueError(f"{NAME}: this model has no MoE layers")
    try:
        t = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{NAME} must be an integer tensor [B, S, L_moe, k], got {type(value).__name__}: {e}")
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise ValueError(f"{NAME} must hold integer expert ids, got dtype {t.dtype}")
    b, s = batch["input_ids"].shape
    want = (b, s, num_layers, topk)
    if tuple(t.shape) != want:
        raise ValueError(f"{NAME} must be [B, S, L_moe, k] = {list(want)} (L_moe MoE layers, top-{topk}), "
                         f"got {list(t.shape)}")
    t = t.long().cpu()
    mask = batch.get("attention_mask")
    real = torch.ones(b, s, dtype=torch.bool) if mask is None else torch.as_tensor(mask).bool().cpu()
    kept = t[real]   # [N, L, k]
    bad = ((kept < 0) | (kept >= num_experts)).nonzero()
    if len(bad):
        at = real.nonzero()[bad[0, 0]].tolist()
        raise ValueError(f"{NAME}: expert ids must be in [0, {num_experts}), got "
                         f"{int(kept[tuple(bad[0])])} at [{at[0]}, {at[1]}, {int(bad[0, 1])}]")
    srt = kept.sort(-1).values
    dup = (srt[..., 1:] == srt[..., :-1]).any(-1).nonzero()
    if len(dup):
        at = real.nonzero()[dup[0, 0]].tolist()
        raise ValueError(f"{NAME}: the k ids of one token must differ, got {kept[tuple(dup[0])].tolist()} "
                         f"at [{at[0]}, {at[1]}] layer {int(dup[0, 1])}")
    return torch.where(real[..., None, None], t, torch.arange(topk).expand_as(t))


def _filler(shape, topk: int, device) -> torch.Tensor:
    """Ids 0 .. k-1 for padding tokens: [*shape, k] int64."""
    return torch.arange(topk, device=device).expand(*shape, topk).clone()


def model_view(x: torch.Tensor, mb, topk: int) -> torch.Tensor:
    """Per-token ids of micro-batch ``mb`` in its row layout [mbs, S_row, ...] -> the layout the
    model gets ([rows, S_model, ...]: this CP rank's positions, or one THD row padded with ids
    ``0 .. k-1``; :meth:`.layout.Layout.model_view`)."""
    return mb.layout.model_view(x, fill=lambda shape, dtype, device: _filler(shape[:-1], topk, device))


class ReplayOnBackward(torch.autograd.Function):
    """``output`` unchanged (a copy: megatron may free a pipeline output's storage); its backward
    switches ``routers`` to REPLAY_BACKWARD before any of their layers is recomputed."""

    @staticmethod
    def forward(ctx, output, routers_):
        ctx.routers = routers_
        return output.clone()

    @staticmethod
    def backward(ctx, grad):
        from megatron.core.transformer.moe.router_replay import RouterReplayAction
        for r in ctx.routers:
            r.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
        return grad, None


class Routing:
    """Router replay / recording for one call (see the module docstring). ``replay``: the checked
    [B, S, L_moe, k] ids (:func:`check`) or None; ``record``: return the ids used. Laid onto
    ``micro_batches`` (the call's, in row order) at construction; :meth:`before` / :meth:`after`
    wrap each chunk forward, :meth:`result` assembles the recorded ids (collective over the
    pipeline group), :meth:`reset` puts the routers back (always, after the schedule)."""

    def __init__(self, engine, micro_batches: List[dict], shape, *, replay: Optional[torch.Tensor], record: bool,
                 topk: int):
        config = engine.config
        if config.moe_router_fusion:
            raise NotImplementedError(f"{NAME} / return_routed_experts with moe_router_fusion: TE's fused "
                                      "top-k does not call megatron's RouterReplay")
        self.engine, self.shape, self.record, self.topk = engine, shape, record, topk
        layers = moe_layers(config)
        self.num_layers = len(layers)
        self.index = {n: i for i, n in enumerate(layers)}     # layer number -> L_moe index
        self.chunk_routers = [routers(c) for c in engine.chunks]
        for rs in self.chunk_routers:
            for r in rs:
                if r.routing_type == "sinkhorn":
                    raise NotImplementedError(f"{NAME} with sinkhorn routing (megatron does not replay it)")
                if r.layer_number not in self.index:
                    raise RuntimeError(f"router of layer {r.layer_number} is not among the MoE layers {layers}")
        self.mb_index = {id(mb): i for i, mb in enumerate(micro_batches)}
        self.rows = []          # per micro-batch: (first user row, rows, row length)
        at = 0
        for mb in micro_batches:
            n, length = mb.loss_labels.shape
            self.rows.append((at, n, length))
            if replay is not None:
                part = replay[at:at + n].to(mb.input_ids.device)
                pad = length - part.shape[1]
                if pad:
                    part = torch.cat([part, _filler((n, pad, self.num_layers), topk, part.device)], 1)
                mb.routed_experts = part
            at += n
        self.replay = replay is not None
        self.recorded: Dict[int, Dict[int, torch.Tensor]] = {}   # micro-batch -> L_moe index -> [n, S_row, k]

    def _sp(self):
        mesh = self.engine.mesh
        if not mesh.sequence_parallel or mesh.tp_size == 1:
            return None
        from megatron.core import parallel_state as ps
        return ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank(), mesh.tp_size

    def before(self, index: int, mb: dict) -> None:
        """Before chunk ``index``'s forward of ``mb``: its routers' action and ids."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction
        rs = self.chunk_routers[index]
        if not rs:
            return
        if not self.replay:
            for r in rs:
                r.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
            return
        ids = model_view(mb.routed_experts, mb, self.topk).transpose(0, 1)     # [S_model, rows, L, k]
        sp = self._sp()
        if sp is not None:
            _, rank, tp = sp
            n = ids.shape[0] // tp
            ids = ids[rank * n:(rank + 1) * n]
        ids = ids.reshape(-1, self.num_layers, self.topk)
        for r in rs:
            r.router_replay.set_target_indices(ids[:, self.index[r.layer_number]].contiguous())
            r.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def after(self, index: int, mb: dict, output: torch.Tensor, recompute: bool) -> torch.Tensor:
        """After chunk ``index``'s forward of ``mb``: the ids its routers used, kept (recording),
        and ``output`` through :class:`ReplayOnBackward` when recomputed layers will replay."""
        rs = self.chunk_routers[index]
        if self.record:
            rows_model = mb.input_ids.shape[0]
            sp = self._sp()
            for r in rs:
                ids = r.routed.reshape(-1, rows_model, self.topk)      # [S_local, rows, k]
                if sp is not None:
                    group, _, tp = sp
                    parts = [torch.empty_like(ids) for _ in range(tp)]
                    dist.all_gather(parts, ids.contiguous(), group=group)
                    ids = torch.cat(parts, 0)
                # [rows, S_model, k] -> the row layout (CP: all-gathered over the CP group)
                ids = mb.layout.to_rows(ids.transpose(0, 1).contiguous())
                self.recorded.setdefault(self.mb_index[id(mb)], {})[self.index[r.layer_number]] = ids
        if self.replay and recompute and rs and output.requires_grad:
            output = ReplayOnBackward.apply(output, rs)
        return output

    def result(self) -> torch.Tensor:
        """The recorded ids, [B, S, L_moe, k] int64 (CPU), the same on every rank of the
        pipeline group (collective over it)."""
        from megatron.core import parallel_state as ps
        b, s = self.shape
        device = self.engine.device
        out = torch.zeros(b, s, self.num_layers, self.topk, dtype=torch.int64, device=device)
        for i, layers in self.recorded.items():
            at, n, _ = self.rows[i]
            for l, ids in layers.items():
                out[at:at + n, :, l] = ids[:, :s].to(device)
        if ps.get_pipeline_model_parallel_world_size() > 1:
            dist.all_reduce(out, group=ps.get_pipeline_model_parallel_group())
        return out.cpu()

    def reset(self) -> None:
        """Every router back to megatron's own routing, no ids held."""
        for rs in self.chunk_routers:
            for r in rs:
                r.router_replay.clear_indices()
                r.router_replay.clear_router_replay_action()
                r.routed = None
        self.recorded = {}
