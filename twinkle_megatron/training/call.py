"""What one ``forward_backward`` / ``forward_only`` call runs: a :class:`Call`, planned before the
schedule starts, read by :func:`.schedule.run`.

Every call goes one way: the facade resolves the adapter(s) and makes a :class:`Request`;
:func:`prepare` checks it on every rank (the batch, the loss arguments, ``routed_experts``; the ranks
of a replica agree or all raise) and plans its :class:`Call`; :func:`run` runs the schedule inside a
transaction (:mod:`.transaction`): a call that raises leaves nothing behind.

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
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import validate
from ..parallel.mesh import facade_group
from . import arguments, batching, losses, metrics, reduction, router_replay, schedule, transaction
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
    def max_names(self) -> frozenset:
        return reduction.max_metric_names(self.loss)

    @property
    def total_names(self) -> frozenset:
        return reduction.total_metric_names(self.loss)

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
    megatron's own routing, nothing returned); ``logits``: whether the [B, S, V] logits are
    returned (``return_logits=True``, :func:`.loss_step.token_logits`); ``argmax``: whether
    ``LossInputs.argmax_correct`` is computed (a metric's ``needs_argmax``)."""
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
    logits: bool = False
    argmax: bool = False


def check_task(task) -> str:
    """Upstream Twinkle's ``task=`` of ``forward_backward`` / ``forward_only``: ``'causal_lm'`` (or
    None) or ``'embedding'`` (:mod:`.embedding`), returned; anything else is a ValueError."""
    if task is None or task == "causal_lm":
        return "causal_lm"
    if task == "embedding":
        return task
    raise ValueError(f"task must be 'causal_lm' or 'embedding', got {task!r}")


def refuse_embedding_loss(loss) -> None:
    """A causal LM call whose loss is ``task='embedding'``'s (:class:`.embedding.InfonceLoss`) is a
    ValueError saying so, before anything runs."""
    if getattr(loss, "task", None) == "embedding":
        raise ValueError(f"the loss {getattr(loss, 'name', type(loss).__name__)!r} is task='embedding''s: pass "
                         "task='embedding' (sentence rows with group labels), or set_loss a causal LM loss")


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
         routed_experts: Optional[torch.Tensor] = None, return_routed_experts: bool = False,
         return_logits: bool = False) -> Call:
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
                routing=routing, logits=bool(return_logits),
                argmax=any(getattr(g.loss, "needs_argmax", False) for g in the_groups))


def group(state: TrainState, rows: List[int], *, loss=None, forward_only: bool = False, samples: int = 0,
          args: Optional[dict] = None) -> Group:
    """The :class:`Group` of ``state`` over ``rows``: its loss (``loss``, default the state's) with
    its user metrics, the meter of a training or ``forward_only`` call."""
    loss = state.loss if loss is None else loss
    user = {k: e for k, e in state.user_metrics.items() if metrics.applies(e, not forward_only)}
    if user:
        loss = metrics.WithMetrics(loss, user)
    return Group(state=state, rows=list(rows), loss=loss, keys=tuple(args or ()),
                 meter=state.eval_metric if forward_only else state.metric, samples=samples)


# ---- the one way in: a request, prepared, run --------------------------------------------------

@dataclasses.dataclass
class Request:
    """One ``forward_backward`` / ``forward_only`` call as the facade received it, its adapter
    resolved. ``state``: the :class:`.engine.TrainState` the call runs, or None for a mixed call
    (``adapter_names``: one adapter name per row; ``check_names(adapter_names, rows)`` checks them
    against the facade's adapters; ``router(names)`` makes the LoRA router of those adapters,
    :class:`twinkle_megatron.lora.mixed.MixedRun`). The other fields are the call's keywords."""
    inputs: object
    state: Optional[TrainState] = None
    micro_batch_size: Optional[int] = None
    loss_kwargs: dict = dataclasses.field(default_factory=dict)
    forward_only: bool = False
    return_logps: bool = False
    return_entropy: bool = False
    temperature: float = 1.0
    return_topk: int = 0
    routed_experts: object = None
    return_routed_experts: bool = False
    return_logits: bool = False
    adapter_names: Optional[Sequence[str]] = None
    check_names: Optional[Callable[[Sequence[str], int], List[str]]] = None
    router: Optional[Callable[[List[str]], object]] = None
    #: (inputs, loss_kwargs) -> the inputs and loss arguments the facade takes (conversations encoded
    #: by the model's chat template, samples packed by set_processor(padding_free=True)); run inside
    #: the checks, so that a failure is agreed by every rank
    encode: Optional[Callable[[object, dict], Tuple[object, dict]]] = None


@dataclasses.dataclass
class Prepared:
    """A checked request: its :class:`Call`, the ``states`` it trains or evaluates (the
    transaction's), and the adapters' ``names`` in group order (a mixed call's)."""
    call: Call
    states: List[TrainState]
    names: List[Optional[str]]


def checked_batch(engine: Engine, inputs, micro_batch_size, loss_check=None, encode=None, loss_kwargs=None):
    """``inputs`` normalised and validated on every rank at once, before any collective of the
    step (:func:`twinkle_megatron.validate.agree_on_inputs`): a bad batch on one rank raises on all
    of them. ``loss_check(batch)`` (the loss arguments and ``routed_experts`` checked against the
    batch) is part of that check, and its tensors must be equal on the ranks of a replica
    (checksums; :class:`~twinkle_megatron.validate.InputMismatchError` on every rank otherwise);
    returns ``(batch, its result)``. ``encode(inputs, loss_kwargs)`` runs first, inside the same
    check; ``loss_check(batch, loss_kwargs)`` gets what it returned."""
    from megatron.core import parallel_state as ps
    vocab = engine.shape.vocab_size
    try:
        kwargs = dict(loss_kwargs or {})
        if encode is not None:
            inputs, kwargs = encode(inputs, kwargs)
        batch, error, checked = batching.to_batch(inputs), None, None
        # the loss arguments are checked against a batch that passed the batch checks
        if loss_check is not None and validate.check_batch(batch, vocab) is None:
            checked = loss_check(batch, kwargs)
    except (TypeError, ValueError, KeyError) as e:
        batch, error, checked = None, e, None
    # the ranks of a replica must also agree on the loss arguments and routed_experts
    validate.agree_on_inputs(batch, micro_batch_size, vocab, error=error, dp_rank=ps.get_data_parallel_rank(),
                             same_micro_batches=engine.mesh.ep_size > 1 or engine.aux is not None,
                             group=facade_group(), arguments=validate.argument_checksums(checked))
    return batch, checked


def routed_experts(engine: Engine, batch, value):
    """``routed_experts`` checked against ``batch`` (:func:`.router_replay.check`), or None."""
    if value is None:
        return None
    shape = engine.shape
    return router_replay.check(value, batch, num_experts=shape.num_experts,
                               num_layers=len(router_replay.moe_layers(engine.config)), topk=shape.moe_topk)


def prepare(engine: Engine, request: Request) -> Prepared:
    """Check ``request`` on every rank and plan its :class:`Call` (nothing of the model changes
    here). Single-state calls: one group owning every row; ``forward_only`` evaluates the state's
    loss when its arguments are given, else cross entropy. Mixed calls: one group per adapter with
    rows on any data-parallel rank."""
    r = request
    vocab = engine.shape.vocab_size
    if r.adapter_names is not None:
        return _prepare_mixed(engine, r)
    state = r.state
    if not r.forward_only:
        refuse_embedding_loss(state.loss)

    def check(b, kwargs):
        if r.return_routed_experts and not engine.shape.num_experts:
            raise ValueError("return_routed_experts=True: this model has no MoE layers")
        return (routed_experts(engine, b, r.routed_experts),
                loss_arguments(state.loss, b, kwargs, strict=not r.forward_only, vocab_size=vocab))

    batch, (replay, args) = checked_batch(engine, r.inputs, r.micro_batch_size, loss_check=check, encode=r.encode,
                                          loss_kwargs=r.loss_kwargs)
    rows = range(len(batch["input_ids"]))
    if r.forward_only:
        # (task='embedding''s loss does not apply to token rows: cross entropy is reported)
        own = args is not None and getattr(state.loss, "task", None) != "embedding"
        loss = state.loss if own else losses.CrossEntropyLoss(getattr(state.loss, "ignore_index", -100))
        the_group = group(state, rows, loss=loss, forward_only=True, args=args)
    else:
        the_group = group(state, rows, args=args, samples=len(rows) * engine.mesh.dp_size)
    planned = plan(engine, batch, r.micro_batch_size, [(the_group, args)], forward_only=r.forward_only,
                   return_logps=r.return_logps, return_entropy=r.return_entropy, temperature=r.temperature,
                   return_topk=r.return_topk, routed_experts=replay, return_routed_experts=r.return_routed_experts,
                   return_logits=r.return_logits)
    return Prepared(planned, [state], [state.name])


def _prepare_mixed(engine: Engine, r: Request) -> Prepared:
    refuse_mixed(engine)
    vocab = engine.shape.vocab_size

    def check(batch, kwargs):
        row_names = r.check_names(r.adapter_names, len(batch["input_ids"]))
        return (row_names, routed_experts(engine, batch, r.routed_experts),
                mixed_arguments(engine.states, batch, row_names, kwargs, vocab_size=vocab))

    batch, (row_names, replay, per) = checked_batch(engine, r.inputs, r.micro_batch_size, loss_check=check,
                                                    encode=r.encode, loss_kwargs=r.loss_kwargs)
    order = [n for n in engine.states if n is not None]
    samples = rows_everywhere(engine, order, row_names)
    names = list(samples)
    parts = []
    for n, count in samples.items():
        rows, args = per.get(n, ([], {}))
        parts.append((group(engine.states[n], rows, args=args, samples=count), args))
    planned = plan(engine, batch, r.micro_batch_size, parts, forward_only=False, return_logps=r.return_logps,
                   return_entropy=r.return_entropy, temperature=r.temperature, router=r.router(names),
                   routed_experts=replay, return_logits=r.return_logits)
    return Prepared(planned, [engine.states[n] for n in names], names)


def run(engine: Engine, prepared: Prepared) -> List[dict]:
    """Run a prepared call's schedule as one transaction over its states (a call that raises
    leaves no trace: grads as before the call, counters, meters, RNG; ``forward_only`` has no
    grads to keep); its results, one per group."""
    with transaction.guard(engine, prepared.states, grads=not prepared.call.forward_only):
        return schedule.run(engine, prepared.call)
