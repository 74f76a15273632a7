"""What one ``forward_backward`` / ``forward_only`` call runs: a :class:`Call`, planned before the
schedule starts, read by :func:`.schedule.run`.

A call trains one or more *groups*: each group is one :class:`.engine.TrainState` (an adapter,
or the base model) with the rows of the batch it owns, its loss and the loss arguments of those
rows. A single-adapter call is a call with one group that owns every row; a mixed batch
(``forward_backward(adapter_names=[...])``) has one group per adapter with rows in the batch on
any data-parallel rank. The schedule path is the same: one ``forward_step``, one loss function
that evaluates each group's loss on its rows, unnormalised, so that backpropagating their sum
gives each adapter exactly the gradient of its rows alone (a row's tokens only meet tokens of
the same row; see :mod:`twinkle_megatron.lora.mixed` for the LoRA side, the ``router`` of a
mixed call, which adds every adapter's deltas to its own tokens).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import arguments, batching, metrics, reduction, router_replay
from .engine import Engine, TrainState


@dataclasses.dataclass
class Group:
    """One state trained (or evaluated) by a call: ``rows`` of the user's batch (this rank's
    share), ``loss`` (with the state's user metrics), the names of its loss arguments ``keys``,
    the ``meter`` recording the call, and ``samples``: the rows it counts in
    ``consumed_train_samples`` (over every data-parallel rank)."""
    state: TrainState
    rows: List[int]
    loss: object
    keys: Tuple[str, ...]
    meter: metrics.Meter
    samples: int = 0

    @property
    def metric_names(self) -> Tuple[str, ...]:
        return reduction.metric_names(self.loss)

    @property
    def width(self) -> int:
        """Length of the group's statistics row (:func:`.reduction.evaluate`)."""
        return 3 + 2 * len(self.metric_names)


@dataclasses.dataclass
class Call:
    """A planned call: its ``groups``; the ``micro_batches`` (:func:`.batching.micro_batches`, each
    with ``row_groups`` [mbs] / ``adapter_groups`` when there are several groups), their
    ``micro_batch_size`` and ``seq_length``; the user batch's ``shape`` (B, S); whether it is
    ``forward_only``; the log-prob ``temperature``; whether per-token ``entropy`` is computed
    (``with_entropy``) and the per-token outputs returned (``keep``); ``router``: with several
    groups, the LoRA hooks that add each token's adapter's deltas (an object with a settable
    ``groups`` and ``restore_on_backward(output)``; :class:`twinkle_megatron.lora.mixed.MixedRun`);
    ``topk``: k of ``forward_only(return_topk=k)`` (0: none), the top k of the log-softmax per
    token returned as ``topk_logps`` / ``topk_indices`` (:func:`.loss_step.token_topk`);
    ``routing``: the call's MoE router replay / recording (:class:`.router_replay.Routing`, None:
    megatron's own routing, nothing returned)."""
    groups: List[Group]
    micro_batches: List[batching.MicroBatch]
    micro_batch_size: int
    seq_length: int
    shape: Tuple[int, int]
    forward_only: bool
    temperature: float
    with_entropy: bool
    keep: bool
    router: object = None
    topk: int = 0
    routing: object = None


def loss_arguments(loss, batch: Dict[str, torch.Tensor], loss_kwargs: dict, *, strict: bool,
                   vocab_size: Optional[int] = None):
    """``loss_kwargs`` checked against ``loss`` and brought to the user's [B, S] fp32 layout for
    ``batch`` ([B, S, k] for top-k arguments, vocabulary ids checked against ``vocab_size``;
    :func:`.arguments.prepare_arguments`); None when not ``strict`` and a required argument is
    missing (forward_only then reports cross entropy)."""
    labels = batching.user_labels(batch, getattr(loss, "ignore_index", -100))
    loss_mask = labels != -100
    loss_mask[:, 0] = False    # position 0 is never predicted (HF shift)
    return arguments.prepare_arguments(loss, loss_kwargs, labels, loss_mask, strict=strict, vocab_size=vocab_size)


def _row_arguments(value, rows: List[int]):
    if torch.is_tensor(value) or hasattr(value, "shape"):
        return torch.as_tensor(value)[rows]
    return [value[i] for i in rows]


def mixed_arguments(states: Dict[Optional[str], TrainState], batch, names: List[str],
                    loss_kwargs: dict, vocab_size: Optional[int] = None) -> Dict[str, tuple]:
    """Per adapter of ``names`` (one per row): ``(rows, its loss arguments [B_a, S] fp32)`` ([B_a,
    S, k] for top-k ones); each argument goes to the adapters whose loss takes it (sliced to their
    rows), as if their rows had been sent alone. An argument no adapter's loss takes is a
    TypeError."""
    per, used = {}, set()
    for n in dict.fromkeys(names):
        rows = [i for i, m in enumerate(names) if m == n]
        loss = states[n].loss
        accepts = tuple(getattr(loss, "accepts", ()))
        refused = dict(getattr(loss, "unsupported", None) or {})   # prepare_arguments says why
        kwargs = {k: _row_arguments(v, rows) for k, v in loss_kwargs.items()
                  if (k in accepts or k in refused) and v is not None}
        used.update(kwargs)
        sub = {k: v[rows] for k, v in batch.items()}
        per[n] = (rows, loss_arguments(loss, sub, kwargs, strict=True, vocab_size=vocab_size))
    unused = sorted(k for k, v in loss_kwargs.items() if v is not None and k not in used)
    if unused:
        raise TypeError(f"forward_backward: no adapter in adapter_names has a loss that takes {unused}")
    return per


def refuse_mixed(engine: Engine) -> None:
    """What a mixed batch cannot run, with the reason."""
    if engine.dtype == torch.float16:
        raise NotImplementedError("adapter_names= with mixed_precision='fp16': each adapter's optimizer "
                                  "has its own loss scale, a mixed batch has one backward; use bf16 or fp32")
    if engine.aux is not None:
        raise NotImplementedError("adapter_names= with the MoE aux loss on: the load-balancing loss mixes "
                                  "every row's router statistics; set router_aux_loss_coef=0 or send each "
                                  "adapter's rows with adapter_name=")
    if engine.overlap.overlap_grad_reduce:
        raise NotImplementedError("adapter_names= with overlap_grad_reduce=True: each adapter's DDP wrap "
                                  "would launch its own bucket reductions inside the one backward; "
                                  "turn overlap_grad_reduce off for mixed batches")


def rows_everywhere(engine: Engine, order: Sequence[str], names_here: List[str]) -> Dict[str, int]:
    """``{name: rows over every data-parallel rank}`` for the names of ``order`` with any row
    (``names_here``: this rank's rows' names); the same on every rank, in ``order``."""
    from megatron.core import parallel_state as ps
    counts = torch.tensor([float(names_here.count(n)) for n in order], dtype=torch.float64, device=engine.device)
    if ps.get_data_parallel_world_size() > 1:
        dist.all_reduce(counts, group=ps.get_data_parallel_group())
    return {n: int(c) for n, c in zip(order, counts.tolist()) if c > 0}


def plan(engine: Engine, batch: Dict[str, torch.Tensor], micro_batch_size: Optional[int],
         groups: List[Tuple[Group, Optional[dict]]], *, forward_only: bool, return_logps: bool,
         return_entropy: bool, temperature: float, router=None, return_topk: int = 0,
         routed_experts: Optional[torch.Tensor] = None, return_routed_experts: bool = False) -> Call:
    """The :class:`Call` of ``batch`` (this rank's validated share, [B, S] tensors) for ``groups``:
    ``(group, its loss arguments [len(rows), S] fp32 or None)`` each. Each group's
    ``ignore_index`` is applied to its rows' labels here, so one label convention (-100) runs
    below; the arguments are laid out over the batch's rows (0 on other groups' rows; [B, S, k]
    top-k arguments in their dtype). Each micro-batch's ``student_topk`` names the arguments at
    whose ids the loss step computes the student's logits (the groups' losses' ``student_topk``).
    ``return_topk``: k of the per-token top-k outputs (0: none; :attr:`Call.topk`).
    ``routed_experts``: the checked [B, S, L_moe, k] ids to replay (:func:`.router_replay.check`);
    ``return_routed_experts``: record the ids routed with (:attr:`Call.routing`)."""
    b, s = batch["input_ids"].shape
    labels = batch["labels"].clone()
    full_args: Dict[str, torch.Tensor] = {}
    for group, args in groups:
        rows = group.rows
        ignore = getattr(group.loss, "ignore_index", -100)
        if ignore != -100 and rows:
            labels[rows] = labels[rows].masked_fill(labels[rows] == ignore, -100)
        for k, v in (args or {}).items():
            v = v if v.dim() == 3 else v.float()
            have = full_args.get(k)
            if have is not None and (have.shape[2:] != v.shape[2:] or have.dtype != v.dtype):
                raise ValueError(f"{k}: the adapters' rows give it shapes {tuple(have.shape[1:])} and "
                                 f"{tuple(v.shape[1:])}; they must agree in one batch")
            if have is None:
                have = full_args[k] = torch.zeros(b, s, *v.shape[2:], dtype=v.dtype)
            have[rows] = v
    batch = dict(batch, labels=labels)
    mbs_list, mbs, seq = batching.micro_batches(engine.mesh, engine.device, batch, micro_batch_size, full_args)
    the_groups = [g for g, _ in groups]
    if router is not None or len(the_groups) > 1:
        row_groups = torch.full((b,), -1, dtype=torch.long)
        for j, g in enumerate(the_groups):
            row_groups[g.rows] = j
        at = 0
        for mb in mbs_list:
            mine, at = row_groups[at:at + mb.rows], at + mb.rows     # the user's rows, in order
            mb.row_groups = mine.to(engine.device)
            mb.adapter_groups = mb.layout.token_groups(mine).to(engine.device)
    topk = tuple(dict.fromkeys(n for g in the_groups for n in [getattr(g.loss, "student_topk", None)]
                               if n is not None and n in full_args))
    if topk:
        for mb in mbs_list:
            mb.student_topk = topk
    with_entropy = bool(return_entropy or any(getattr(g.loss, "needs_entropy", False) for g in the_groups))
    routing = None
    if routed_experts is not None or return_routed_experts:
        routing = router_replay.Routing(engine, mbs_list, (b, s), replay=routed_experts,
                                        record=bool(return_routed_experts), topk=engine.config.moe_router_topk)
    return Call(groups=the_groups, micro_batches=mbs_list, micro_batch_size=mbs, seq_length=seq, shape=(b, s),
                forward_only=forward_only, temperature=temperature, with_entropy=with_entropy,
                keep=bool(return_logps or return_entropy), router=router, topk=int(return_topk or 0),
                routing=routing)


def group(state: TrainState, rows: List[int], *, loss=None, forward_only: bool = False, samples: int = 0,
          args: Optional[dict] = None) -> Group:
    """The :class:`Group` of ``state`` over ``rows``: its loss (``loss``, default the state's) with
    its user metrics, the meter of a training or ``forward_only`` call."""
    loss = state.loss if loss is None else loss
    if state.user_metrics:
        loss = metrics.WithMetrics(loss, state.user_metrics)
    return Group(state=state, rows=list(rows), loss=loss, keys=tuple(args or ()),
                 meter=state.eval_metric if forward_only else state.metric, samples=samples)
