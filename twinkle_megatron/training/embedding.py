"""Upstream Twinkle's ``task='embedding'``: sentence embeddings from the causal LM, trained with
its InfoNCE loss.

A call's rows are sentences, one per row (right padding, ``attention_mask``), each with a group
label: 1 starts a group (its anchor), 0 continues it (the first 0 is the anchor's positive, the
rest its hard negatives), as upstream's ``anchor(1) + positive(1) + negatives(n)`` layout. The
embedding of a sentence is the model's final hidden state (after the final norm, the input of
the LM head; never the logits) at its last real token, L2-normalised (:func:`pool`); the last
pipeline stage computes it, in fp32 (float64 for a float64 model).

:class:`InfonceLoss` is upstream's ``InfonceLoss`` (:func:`infonce`): with ``use_batch`` the
groups of a micro-batch over every data-parallel rank share their documents as negatives (the
embeddings are all-gathered over the data-parallel group; each rank's gradient flows into its
own sentences only and the data-parallel reduction adds them up, so the gradient is exactly the
one of the loss of the gathered batch). :func:`run` is the schedule of one call.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import packing, validate
from ..parallel.mesh import facade_group
from . import batching, losses, metrics, reduction, transaction
from .engine import Engine, TrainState, eval_mode


class InfonceLoss:
    """Upstream Twinkle's InfoNCE loss of ``task='embedding'`` (``set_loss('InfonceLoss', ...)``).

    Over the groups of a micro-batch (see the module docstring), with ``q`` a group's anchor,
    ``d+`` its positive, ``docs`` every group's documents (positives and negatives, in order) and
    ``s(a, b) = a . b`` (cosine: the embeddings are unit vectors), the loss of a group is the
    cross entropy of ``logits / temperature`` with the positive as target, where ``logits`` is:

    - ``use_batch=False``: ``s(q, d)`` for the group's own documents only;
    - ``use_batch=True``: ``s(q, docs)`` over every group's documents (in-batch negatives, over
      the data-parallel ranks), then with ``include_qq`` ``s(q, anchors)`` (its own one -inf),
      with ``include_dd`` ``s(d+, docs)`` (its own positive -inf); ``mask_fake_negative``: in the
      first two blocks, a logit above ``s(q, d+) + fake_neg_margin`` is set to -inf (not in the
      third, as upstream and Qwen3-Embedding).

    The loss is the mean over the groups of the call (upstream: the mean over micro-batches of
    their groups' mean, the same when micro-batches hold as many groups). ``hard_negatives=n``
    keeps the first n negatives of each group; a group with fewer is a ValueError (upstream
    repeats random ones, drawn from the group's positions 1 .. k for k negatives: the positive
    among them). ``temperature`` must be > 0, ``fake_neg_margin`` > 0 with
    ``mask_fake_negative`` (ValueError); ``process_group`` must be None (TypeError: the
    data-parallel group of the model's mesh is used, the one upstream's ``MegatronModel`` sets)."""
    name = "infonce"
    task = "embedding"
    metric_names: Tuple[str, ...] = ()
    accepts: Tuple[str, ...] = ()
    required: Tuple[str, ...] = ()

    def __init__(self, temperature: float = 0.1, use_batch: bool = True, hard_negatives: Optional[int] = None,
                 mask_fake_negative: bool = False, fake_neg_margin: float = 0.1, include_qq: bool = False,
                 include_dd: bool = False, process_group=None):
        for key, v in (("temperature", temperature), ("fake_neg_margin", fake_neg_margin)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"InfonceLoss: {key} must be a finite number, got {v!r}")
        if temperature <= 0:
            raise ValueError(f"InfonceLoss: temperature must be > 0, got {temperature!r}")
        if mask_fake_negative and fake_neg_margin <= 0:
            raise ValueError(f"InfonceLoss: fake_neg_margin must be > 0 with mask_fake_negative=True, got "
                             f"{fake_neg_margin!r} (the positive itself would be masked)")
        if hard_negatives is not None and (isinstance(hard_negatives, bool) or not isinstance(hard_negatives, int)
                                           or hard_negatives < 1):
            raise ValueError(f"InfonceLoss: hard_negatives must be None or a positive int, got {hard_negatives!r}")
        for key, v in (("use_batch", use_batch), ("mask_fake_negative", mask_fake_negative),
                       ("include_qq", include_qq), ("include_dd", include_dd)):
            if not isinstance(v, bool):
                raise TypeError(f"InfonceLoss: {key} must be a bool, got {v!r}")
        if process_group is not None:
            raise TypeError("InfonceLoss: process_group is not taken here: the in-batch negatives are gathered "
                            "over the data-parallel group of the model's mesh")
        self.temperature, self.use_batch, self.hard_negatives = float(temperature), use_batch, hard_negatives
        self.mask_fake_negative, self.fake_neg_margin = mask_fake_negative, float(fake_neg_margin)
        self.include_qq, self.include_dd = include_qq, include_dd

    def __call__(self, inputs):
        raise ValueError("InfonceLoss is the loss of task='embedding': call forward_backward(..., task='embedding') "
                         "with sentence rows, or set_loss another loss for causal LM training")


def resolve_loss(loss, **kwargs):
    """:meth:`MegatronModel.set_loss`'s loss: upstream's ``'InfonceLoss'`` (also ``'infonce'``, any
    case) is :class:`InfonceLoss` built with ``kwargs``; anything else goes to
    :func:`.losses.resolve_loss`."""
    if isinstance(loss, str) and loss.lower().replace("_", "").replace("-", "") in ("infonce", "infonceloss"):
        loss = InfonceLoss
    return losses.resolve_loss(loss, **kwargs)


def groups_of(labels: List[int], hard_negatives: Optional[int] = None, where: str = "labels") -> List[Tuple[int, int]]:
    """The groups of sentences with group ``labels`` (1 starts a group, 0 continues it) as
    ``(start, end)`` ranges, each cut to ``2 + hard_negatives`` sentences when given; sentences
    before the first 1 belong to no group (upstream drops them). A group of one sentence (no
    positive), or with fewer than ``hard_negatives`` negatives, is a ValueError naming ``where``."""
    starts = [i for i, v in enumerate(labels) if v == 1]
    out = []
    for a, b in zip(starts, starts[1:] + [len(labels)]):
        if b - a < 2:
            raise ValueError(f"{where}: the group starting at sentence {a} has no positive (an anchor, label 1, must "
                             "be followed by its positive, label 0)")
        if hard_negatives is not None:
            if b - a - 2 < hard_negatives:
                raise ValueError(f"{where}: the group starting at sentence {a} has {b - a - 2} negatives, fewer than "
                                 f"hard_negatives={hard_negatives} (upstream repeats random ones; give each group at "
                                 "least that many)")
            b = a + 2 + hard_negatives
        out.append((a, b))
    return out


def infonce(emb: torch.Tensor, groups: List[Tuple[int, int]], loss: InfonceLoss) -> torch.Tensor:
    """The sum over ``groups`` ((start, end) rows of ``emb`` [n, H], unit vectors) of
    :class:`InfonceLoss`'s per-group cross entropy -> a scalar (differentiable)."""
    t = loss.temperature
    if not groups:
        return emb.sum() * 0.0
    if not loss.use_batch:
        total = emb.new_zeros([])
        for a, b in groups:
            logits = (emb[a] @ emb[a + 1:b].T) / t
            total = total + torch.logsumexp(logits, 0) - logits[0]
        return total
    q = emb[[a for a, _ in groups]]                                       # [G, H]
    doc_rows = [i for a, b in groups for i in range(a + 1, b)]
    docs = emb[doc_rows]                                                  # [D, H]
    starts = torch.tensor([0] + [b - a - 1 for a, b in groups][:-1], device=emb.device).cumsum(0)
    rows = torch.arange(len(groups), device=emb.device)
    ninf = torch.full((), float("-inf"), dtype=emb.dtype, device=emb.device)
    qd = q @ docs.T                                                       # [G, D]
    blocks = [qd]
    threshold = qd[rows, starts].detach()[:, None] + loss.fake_neg_margin
    if loss.include_qq:
        qq = q @ q.T
        blocks.append(qq.masked_fill(torch.eye(len(groups), dtype=torch.bool, device=emb.device), float("-inf")))
    if loss.mask_fake_negative:
        blocks = [torch.where(blk > threshold, ninf, blk) for blk in blocks]
    if loss.include_dd:
        dd = docs[starts] @ docs.T
        own = torch.zeros_like(dd, dtype=torch.bool)
        own[rows, starts] = True
        blocks.append(dd.masked_fill(own, float("-inf")))
    logits = torch.cat(blocks, 1) / t
    return (torch.logsumexp(logits, 1) - logits[rows, starts]).sum()


def refuse_options(call_name: str, given: Dict[str, object], encode) -> None:
    """The keywords of ``forward_backward`` / ``forward_only`` (``call_name``) that mean nothing
    for ``task='embedding'``: ``given`` maps each to whether it was set; one that was is a
    TypeError naming it. ``encode`` (the facade's input encoder, None when there is nothing to
    encode): conversations and ``set_processor(padding_free=True)`` are refused too."""
    bad = sorted(k for k, v in given.items() if v)
    if bad:
        raise TypeError(f"{call_name}(task='embedding'): {bad} do not apply to sentence embeddings (they are "
                        "per-token options of task='causal_lm')")
    if encode is not None:
        raise TypeError(f"{call_name}(task='embedding'): inputs are token ids of one sentence per row; "
                        "conversations (messages) and set_processor(padding_free=True) are not supported here")


# ---- the inputs --------------------------------------------------------------------------------

def sentence_batch(inputs, vocab_size: int) -> Dict[str, torch.Tensor]:
    """Upstream's embedding inputs -> ``{'input_ids' [B, S] int64, 'attention_mask' [B, S] int64,
    'labels' [B] int64 or absent}``: a list of samples ``{'input_ids', 'attention_mask'?,
    'labels'?: 0 / 1 or [0] / [1], 'position_ids'?}`` (right-padded here; a sample's length is its
    ``input_ids``') or a dict of ``input_ids`` [B, S], ``attention_mask`` [B, S], ``labels`` [B]
    (or [B, 1]), ``position_ids`` [B, S]. ``position_ids`` restarting inside a row (packed
    sentences) are refused; others are not read (each row's positions are 0, 1, ...). ValueError
    (TypeError for a wrong container) naming the problem."""
    keys = ("input_ids", "attention_mask", "labels", "position_ids")
    if isinstance(inputs, dict):
        samples = None
        unknown = sorted(set(inputs) - set(keys))
        if unknown:
            raise ValueError(f"task='embedding': inputs has unknown key(s) {unknown}; accepted: {list(keys)}")
        ids = torch.as_tensor(inputs["input_ids"]) if "input_ids" in inputs else None
        if ids is None or ids.dim() != 2:
            raise ValueError("task='embedding': inputs['input_ids'] must be [B, S]")
        mask = torch.as_tensor(inputs["attention_mask"]) if inputs.get("attention_mask") is not None \
            else torch.ones_like(ids)
        labels = None if inputs.get("labels") is None else torch.as_tensor(inputs["labels"])
        pos = None if inputs.get("position_ids") is None else torch.as_tensor(inputs["position_ids"])
    elif isinstance(inputs, (list, tuple)) and inputs and all(isinstance(s, dict) for s in inputs):
        samples = inputs
        for i, s in enumerate(samples):
            unknown = sorted(set(s) - set(keys))
            if unknown or "input_ids" not in s:
                raise ValueError(f"task='embedding': inputs[{i}] needs 'input_ids' and takes {list(keys)}, got "
                                 f"keys {sorted(s)}")
        if len({"labels" in s for s in samples}) > 1:
            raise ValueError("task='embedding': some samples have 'labels' and some not")
        rows = [torch.as_tensor(s["input_ids"]).reshape(-1) for s in samples]
        longest = max(len(r) for r in rows)
        ids = torch.stack([torch.cat([r, r.new_zeros(longest - len(r))]) for r in rows])
        mask = torch.zeros_like(ids)
        for i, (s, r) in enumerate(zip(samples, rows)):
            m = torch.as_tensor(s["attention_mask"]).reshape(-1) if s.get("attention_mask") is not None \
                else torch.ones_like(r)
            if len(m) != len(r):
                raise ValueError(f"task='embedding': inputs[{i}]['attention_mask'] has length {len(m)}, input_ids "
                                 f"has {len(r)}")
            mask[i, :len(r)] = m
        labels = None
        if "labels" in samples[0]:
            one = [torch.as_tensor(s["labels"]).reshape(-1) for s in samples]
            if any(t.numel() != 1 for t in one):
                raise ValueError("task='embedding': each sample's 'labels' must be one group label (1: starts a "
                                 "group, 0: continues it), e.g. [1] or 0")
            labels = torch.cat(one)
        pos = None
        for i, s in enumerate(samples):
            if s.get("position_ids") is not None and packing.is_packed(torch.as_tensor(s["position_ids"])[None]):
                pos = torch.as_tensor(s["position_ids"])[None]
    else:
        raise TypeError(f"task='embedding': inputs must be a dict of tensors or a non-empty list of samples, got "
                        f"{type(inputs).__name__}")
    b, s = ids.shape
    if b == 0 or s == 0:
        raise ValueError(f"task='embedding': inputs['input_ids'] is empty (shape {tuple(ids.shape)})")
    if ids.is_floating_point() or ids.dtype == torch.bool:
        raise ValueError(f"task='embedding': inputs['input_ids'] must hold integers, got {ids.dtype}")
    if mask.shape != ids.shape:
        raise ValueError(f"task='embedding': inputs['attention_mask'] has shape {tuple(mask.shape)}, input_ids has "
                         f"{tuple(ids.shape)}")
    mask = mask.long()
    if bool(((mask != 0) & (mask != 1)).any()) or bool((mask[:, 1:] > mask[:, :-1]).any()):
        raise ValueError("task='embedding': attention_mask must be right padding (1s then 0s per row)")
    if bool((mask.sum(1) == 0).any()):
        raise ValueError("task='embedding': a row has no token (attention_mask all 0)")
    if pos is not None and packing.is_packed(pos if pos.dim() == 2 else pos[None]):
        raise ValueError("task='embedding': position_ids restart inside a row (packed sentences); give one sentence "
                         "per row (set_processor(padding_free=True) is not supported for embeddings)")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"task='embedding': inputs['input_ids'] holds {lo if lo < 0 else hi}, outside the "
                         f"vocabulary [0, {vocab_size})")
    out = {"input_ids": ids.long(), "attention_mask": mask}
    if labels is not None:
        labels = labels.reshape(-1) if labels.dim() == 2 and labels.shape[1] == 1 else labels
        if labels.shape != (b,) or labels.is_floating_point() and bool((labels != labels.round()).any()):
            raise ValueError(f"task='embedding': labels must be one group label per sentence ([B] = [{b}]), got "
                             f"shape {tuple(labels.shape)}")
        labels = labels.long()
        if bool(((labels != 0) & (labels != 1)).any()):
            raise ValueError("task='embedding': labels must be 1 (starts a group: its anchor) or 0 (continues it), "
                             f"got {sorted(set(labels.tolist()))}")
        out["labels"] = labels
    return out


# ---- one call ----------------------------------------------------------------------------------

@dataclasses.dataclass
class _Item:
    mb: batching.MicroBatch
    last: torch.Tensor          # [mbs] the position of each row's last real token
    labels: Optional[torch.Tensor]
    tokens: int


def pool(hidden: torch.Tensor, mb: batching.MicroBatch, last: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """The sentence embeddings of micro-batch ``mb``: ``hidden`` (the last stage's final hidden
    states [s(/ tp), rows, H], after the final norm) at each row's ``last`` token, L2-normalised
    -> [mbs, H] fp32 (float64 for float64 states), differentiable. Under sequence parallelism the
    sequence is gathered over the TP group (its backward hands each rank its own positions: every
    TP rank computes the same loss); under context parallelism over the CP ranks (the layout's
    gather, likewise)."""
    from megatron.core import parallel_state as ps
    if sequence_parallel and ps.get_tensor_model_parallel_world_size() > 1:
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
        hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False,
                                                      group=ps.get_tensor_model_parallel_group())
    rows = mb.layout.to_rows(hidden.transpose(0, 1))                     # [mbs, S, H]
    picked = rows[torch.arange(rows.shape[0], device=rows.device), last.to(rows.device)]
    picked = picked.double() if picked.dtype == torch.float64 else picked.float()
    return F.normalize(picked, p=2, dim=1)


def gather_rows(t: torch.Tensor, group) -> Tuple[torch.Tensor, List[int]]:
    """All-gather ``t`` [n, ...] over ``group`` (the ranks' n may differ): ``(the ranks' rows in
    rank order [sum n, ...], each rank's n)``; only this rank's rows keep their gradient."""
    world = dist.get_world_size(group)
    if world == 1:
        return t, [len(t)]
    n = torch.tensor([len(t)], dtype=torch.long, device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n, group=group)
    sizes = [int(x) for x in sizes]
    top = max(sizes)
    padded = torch.cat([t.detach(), t.new_zeros(top - len(t), *t.shape[1:])]) if len(t) < top else t.detach()
    pieces = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(pieces, padded.contiguous(), group=group)
    me = dist.get_rank(group)
    parts = [t if r == me else pieces[r][:sizes[r]] for r in range(world)]
    return torch.cat(parts), sizes


def run(engine: Engine, state: TrainState, inputs, micro_batch_size: Optional[int], *, forward_only: bool) -> dict:
    """One ``forward_backward`` / ``forward_only`` call with ``task='embedding'`` as one
    transaction (a call that raises leaves nothing behind). Returns, on every rank, ``{'loss',
    'count' (groups), 'num_tokens' (tokens of the sentences), <metrics>, 'embeddings' [B, H] fp32
    CPU (this rank's rows)}``; the loss is :class:`InfonceLoss` (``state.loss``), computed when the
    inputs have labels (required for training); the state's ``EmbeddingMetric`` reports too."""
    from megatron.core import parallel_state as ps
    loss = state.loss
    if not isinstance(loss, InfonceLoss):
        if not forward_only:
            raise ValueError(f"forward_backward(task='embedding') trains with set_loss('InfonceLoss', ...); this "
                             f"model's loss is {getattr(loss, 'name', type(loss).__name__)!r}")
        loss = None
    mesh, device = engine.mesh, engine.device
    if engine.aux is not None:
        raise NotImplementedError("task='embedding' with the MoE aux loss on: set router_aux_loss_coef=0")
    error, batch, group_error = None, None, None
    try:
        batch = sentence_batch(inputs, engine.shape.vocab_size)
        if not forward_only and "labels" not in batch:
            raise ValueError("forward_backward(task='embedding') needs each sentence's group label (inputs' "
                             "'labels': 1 starts a group, 0 continues it)")
    except (TypeError, ValueError, KeyError) as e:
        error = e
    # the batch checks of the token path, every rank at once; the group labels ride in column 0
    check = None if batch is None else {
        "input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
        "labels": torch.full_like(batch["input_ids"], -100).index_put_(
            (torch.arange(len(batch["input_ids"])), torch.zeros(len(batch["input_ids"]), dtype=torch.long)),
            batch.get("labels", torch.full((len(batch["input_ids"]),), -100, dtype=torch.long)))}
    validate.agree_on_inputs(check, micro_batch_size, engine.shape.vocab_size, dp_rank=ps.get_data_parallel_rank(),
                             same_micro_batches=True, group=facade_group(), error=error)
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch.get("labels")
    have = [None] * dist.get_world_size(facade_group())
    dist.all_gather_object(have, labels is not None, group=facade_group())
    if len(set(have)) > 1:   # the loss and the metrics gather over the ranks: all or none
        raise ValueError("task='embedding': some ranks' inputs have 'labels' and some not")
    b = len(ids)
    mbs = micro_batch_size or b
    with_loss = loss is not None and labels is not None
    user = {k: e for k, e in state.user_metrics.items()
            if metrics.applies(e, not forward_only, task="embedding")} if labels is not None else {}
    dp_group = ps.get_data_parallel_group()
    # the groups, from every data-parallel rank's labels of each micro-batch: checked by every rank
    if with_loss:
        mine = [labels[i:i + mbs].tolist() for i in range(0, b, mbs)]
        everyone = [None] * dist.get_world_size(dp_group)
        dist.all_gather_object(everyone, mine, group=dp_group)
        try:
            for k in range(len(mine)):
                if loss.use_batch:
                    groups_of(sum((e[k] for e in everyone), []), loss.hard_negatives,
                              f"labels of micro-batch {k} (over the data-parallel ranks)")
                else:
                    groups_of(mine[k], loss.hard_negatives, f"labels of micro-batch {k}")
        except ValueError as e:
            group_error = e
        validate.agree(group_error, "the group labels", group=facade_group())
    token_batch = {"input_ids": ids, "labels": torch.full_like(ids, -100), "attention_mask": mask}
    mb_list, mbs_model, seq = batching.micro_batches(mesh, device, token_batch, mbs)
    last = mask.sum(1) - 1
    items = [_Item(mb, last[i:i + mbs], None if labels is None else labels[i:i + mbs].to(device),
                   int(mask[i:i + mbs].sum())) for mb, i in zip(mb_list, range(0, b, mbs))]
    meter = state.eval_metric if forward_only else state.metric
    names = tuple(n for e, *_ in user.values() for n in e.names)
    max_names = frozenset(n for e, *_ in user.values() for n in e.max_names)
    width = 3 + 2 * len(names)
    report_dp = ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
    report_cp = ps.get_context_parallel_rank() == 0
    count_total = torch.zeros([], dtype=torch.int, device=device)
    failure = []

    def loss_func(item: _Item, output):
        emb = pool(output, item.mb, item.last, mesh.sequence_parallel)
        # every data-parallel rank gathers, whatever happens next (a collective per micro-batch)
        everything = gather_rows(emb, dp_group)[0] if (with_loss or names) else emb
        every_label = gather_rows(item.labels, dp_group)[0] if item.labels is not None and (with_loss or names) \
            else item.labels
        try:
            return checked(item, emb, everything, every_label)
        except Exception as e:   # re-raised on every rank after the schedule
            failure.append(e)
            zero = output.sum() * 0.0 if output.requires_grad else output.new_zeros([])
            return zero, torch.zeros([], dtype=torch.int, device=device), {
                "stats": torch.zeros(width, dtype=torch.float64, device=device), "emb": emb.detach()}

    def checked(item, emb, everything, every_label):
        nonlocal count_total
        total, count = emb.sum() * 0.0, 0
        if with_loss:
            if loss.use_batch:
                groups = groups_of(every_label.tolist(), loss.hard_negatives)
                total, count, here = infonce(everything, groups, loss), len(groups), report_dp
            else:
                groups = groups_of(item.labels.tolist(), loss.hard_negatives)
                total, count, here = infonce(emb, groups, loss), len(groups), report_cp
            if not here:   # counted once; the gradient still flows into this rank's sentences
                total, count = total - total.detach(), 0
        stats = [total.detach().double(), torch.tensor(float(count), dtype=torch.float64, device=device),
                 torch.tensor(float(item.tokens if report_cp else 0), dtype=torch.float64, device=device)]
        pairs = {}
        for metric, *_ in user.values():
            pairs.update(metric(metrics.SentenceInputs(everything.detach(), every_label)) if report_dp else {})
        for n in names:
            s, c = pairs.get(n, (0.0, 0))
            stats += [torch.as_tensor(s, device=device).double().reshape([]),
                      torch.as_tensor(c, device=device).double().reshape([])]
        c = torch.tensor(count, dtype=torch.int, device=device)
        count_total += c
        return total, c, {"stats": torch.stack(stats), "emb": emb.detach()}

    wrapped = engine.wrapped(state)

    def forward_step(data_iterator, chunk_module):
        item = next(data_iterator)
        mb = item.mb
        output = chunk_module(mb.input_ids, mb.position_ids, None, packed_seq_params=None, return_hidden_states=True)
        return output, functools.partial(loss_func, item)

    from megatron.core.pipeline_parallel import get_forward_backward_func
    chunks = len(wrapped)
    start = time.perf_counter()
    with transaction.guard(engine, [state], grads=not forward_only):
        iterators = [iter(items) for _ in range(chunks)] if chunks > 1 else iter(items)
        with eval_mode(wrapped, forward_only):   # forward_only: no dropout
            results = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iterators, model=wrapped if chunks > 1 else wrapped[0],
                num_microbatches=len(items), seq_length=seq, micro_batch_size=mbs_model, forward_only=forward_only)
        if not forward_only:
            engine.settle_grads([state])
        validate.agree(failure[0] if failure else None,
                       "this call (its loss function raised; the call was rolled back on every rank)",
                       group=facade_group())
        if not forward_only:
            state.pending_tokens = count_total.clone() if state.pending_tokens is None \
                else state.pending_tokens + count_total
            state.has_grads = True
            state.consumed_train_samples += b * mesh.dp_size
        max_at = reduction.max_positions(names, max_names)
        stats, _ = reduction.reduce_results(results, width, (b, ids.shape[1]), device, keep=False,
                                            with_entropy=False, max_at=max_at)
        hidden = engine.shape.hidden_size
        emb = torch.zeros(b, hidden, dtype=torch.float32, device=device)
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            emb = torch.cat([r["emb"].float() for r in results]).to(device)
        if ps.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast(emb, src=ps.get_pipeline_model_parallel_last_rank(),
                           group=ps.get_pipeline_model_parallel_group())
        res, totals, pairs = reduction.read_stats(stats, names, max_names)
        meter.add_fb(*totals, time.perf_counter() - start, pairs, max_names=max_names)
    for metric, *_ in user.values():
        res.update(metric.derive(res))
    res["embeddings"] = emb.cpu()
    return res
