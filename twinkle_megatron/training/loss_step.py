"""The loss end of a megatron forward step: per-token log-probs (and entropy) from this rank's
logits, reassembled into the user's row layout, then the pluggable loss of :mod:`.losses`.

The model sees each micro-batch in one of four layouts (plain rows, context-parallel shares,
packed THD rows, both; :mod:`.layout`), each micro-batch carrying its own: the per-token outputs
are put back into its ``mbs`` rows of ``S`` positions (:meth:`.layout.Layout.to_rows`; under CP
all-gathered, so every CP rank evaluates the same loss on whole rows) and per-token arguments are
laid out as the model sees the tokens (:meth:`.layout.Layout.model_view`).

Per-token arguments (advantages, old/ref logps; [B, S, k] top-k ones too) are given per row in the
user's layout and shifted exactly like the labels (the logit at position t scores label t + 1). A
loss's ``student_topk`` argument (vocabulary ids [B, S, k]) makes :func:`token_outputs` compute the
student's logits at those ids only (:func:`topk_logits`), in the model's layout, then in rows.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import losses as losses_mod
from .layout import GatherContextParallel  # noqa: F401 (its home was here)
from ..layers import lm_head
from ..layers.vocab_parallel import (vocab_parallel_jsd, vocab_parallel_logps, vocab_parallel_topk,
                                     vocab_parallel_topk_logits)


def token_logps(output: torch.Tensor, target: torch.Tensor, *, temperature: float, with_entropy: bool,
                head: Optional[lm_head.OutputHead] = None):
    """(logps, entropy | None), each shaped like ``target`` [rows, s], from the model's output on
    the last pipeline stage: vocab-parallel logits [rows, s, V / tp], or with ``head`` (the fused
    linear cross-entropy path) the final hidden states [s(/ tp), rows, H] and the output layer's
    weight shard (:func:`.layers.lm_head.fused_token_logps`).

    The one place per-token outputs are produced."""
    from megatron.core import parallel_state as ps
    tp = ps.get_tensor_model_parallel_world_size()
    group = ps.get_tensor_model_parallel_group() if tp > 1 else None
    if head is not None:
        return lm_head.fused_token_logps(output, head.weight, target, bias=head.bias, temperature=temperature,
                                         with_entropy=with_entropy, tp_group=group,
                                         sequence_parallel=head.sequence_parallel)
    start = output.shape[-1] * ps.get_tensor_model_parallel_rank()
    return vocab_parallel_logps(output, target, vocab_start=start, group=group,
                                temperature=temperature, with_entropy=with_entropy)


def shift_like_labels(t: torch.Tensor, pad: int = 0, fill: float = 0.0) -> torch.Tensor:
    """User layout [B, S, ...] -> the internal one [B, S + pad, ...]: column t holds user column t + 1."""
    b = t.shape[0]
    return torch.cat([t[:, 1:], t.new_full((b, 1 + pad, *t.shape[2:]), fill)], 1)


def unshift(x: torch.Tensor, s: int) -> torch.Tensor:
    """Internal [B, >= S, ...] -> user layout [B, S, ...]: user column t + 1 from internal column
    t, 0 at 0."""
    out = x.new_zeros(x.shape[0], s, *x.shape[2:])
    out[:, 1:] = x[:, :s - 1]
    return out


def prepare_arguments(loss, loss_kwargs: dict, labels: torch.Tensor, loss_mask: torch.Tensor,
                      *, strict: bool, vocab_size: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """Check ``loss_kwargs`` against what ``loss`` accepts and requires, and bring each to the
    user's [B, S] fp32 layout (see :func:`losses.per_token_argument`), or [B, S, k] for the loss's
    ``topk_arguments`` (:func:`losses.topk_argument`; its ``student_topk`` argument int64 ids,
    checked against ``vocab_size``; one k for all). ``strict``: a missing required argument is an
    error (training); otherwise None is returned (forward_only falls back to cross entropy). An
    argument in the loss's ``unsupported`` raises NotImplementedError."""
    name = getattr(loss, "name", type(loss).__name__)
    for k, why in dict(getattr(loss, "unsupported", None) or {}).items():
        if loss_kwargs.get(k) is not None:
            raise NotImplementedError(f"loss {name!r}: {k}: {why}")
    accepts = tuple(getattr(loss, "accepts", ()))
    unknown = [k for k in loss_kwargs if k not in accepts]
    if unknown:
        raise TypeError(f"loss {name!r} takes no argument(s) {unknown}; it takes {list(accepts)}")
    missing_of = getattr(loss, "missing_arguments", None)      # a loss's own rule (GKD: one teacher of two)
    missing = missing_of(loss_kwargs) if missing_of is not None else [
        k for k in getattr(loss, "required", ()) if loss_kwargs.get(k) is None]
    if missing:
        if strict:
            raise ValueError(f"loss {name!r} needs {missing} (pass them to forward_backward)")
        return None
    wide = tuple(getattr(loss, "topk_arguments", ()) or ())
    ids = getattr(loss, "student_topk", None)
    out = {}
    prepare = getattr(loss, "prepare_argument", None)
    for k, v in loss_kwargs.items():
        if v is None:
            continue
        own = prepare(k, v, labels, loss_mask, vocab_size) if prepare is not None else None
        if own is not None:
            out[k] = own
        elif k in wide:
            out[k] = losses_mod.topk_argument(k, v, labels, loss_mask, integer=k == ids, vocab_size=vocab_size)
        else:
            out[k] = losses_mod.per_token_argument(k, v, labels, loss_mask)
    ks = {k: v.shape[2] for k, v in out.items() if k in wide}
    if len(set(ks.values())) > 1:
        raise ValueError(f"loss {name!r}: the top-k arguments must share k, got {ks}")
    return out


def metric_names(loss) -> Tuple[str, ...]:
    return tuple(getattr(loss, "metric_names", ()))


@dataclasses.dataclass
class TokenOutputs:
    """What the loss step computes from the model's output for one micro-batch, in its rows:
    ``logps`` [mbs, S] fp32, ``entropy`` [mbs, S] fp32 or None, ``mask`` [mbs, S] bool (the loss
    positions), ``student_topk_logits`` {argument: [mbs, S, k] fp32} (the student's raw logits at
    the ids of each of the micro-batch's ``student_topk`` arguments, :func:`topk_logits`), and
    ``teacher_divergence`` (with a ``teacher_logits`` argument: ``f(beta, temperature, rows=None)``,
    :func:`teacher_divergence`; else None)."""
    logps: torch.Tensor
    entropy: Optional[torch.Tensor]
    mask: torch.Tensor
    student_topk_logits: Dict[str, torch.Tensor]
    teacher_divergence: Optional[Callable] = None


def token_outputs(output, mb, *, temperature: float, with_entropy: bool,
                  head: Optional[lm_head.OutputHead] = None) -> TokenOutputs:
    """The :class:`TokenOutputs` of micro-batch ``mb`` (a :class:`.batching.MicroBatch`) in its row
    layout, from the model's output (see :func:`token_logps`)."""
    logps, entropy = token_logps(output, mb.labels.clamp(min=0), temperature=temperature,
                                 with_entropy=with_entropy, head=head)
    layout = mb.layout
    topk = {n: layout.to_rows(topk_logits(output, layout.model_view(mb.extras[n]), head=head))
            for n in mb.student_topk}
    divergence = None
    if losses_mod.TEACHER_LOGITS in mb.extras:     # GKD's full-vocabulary teacher: the loss asks
        divergence = functools.partial(teacher_divergence, output, mb, head)
    return TokenOutputs(logps=layout.to_rows(logps), entropy=None if entropy is None else layout.to_rows(entropy),
                        mask=mb.loss_labels != -100, student_topk_logits=topk, teacher_divergence=divergence)


def teacher_divergence(output, mb, head: Optional[lm_head.OutputHead], beta: float, temperature: float,
                       rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """GKD's generalized JSD per position of micro-batch ``mb`` (row layout [mbs, S] fp32, or
    [len(rows), S] for ``rows``; 0 off the loss positions) against its ``teacher_logits`` argument
    ([mbs, S, V], aligned by :func:`.losses.teacher_logits_argument`), each TP rank taking its
    vocabulary shard: with ``head`` from the final hidden states and the output weight shard chunk
    by chunk (:func:`.layers.lm_head.fused_jsd`), else from the vocab-parallel logits
    (:func:`.layers.vocab_parallel.vocab_parallel_jsd`). Only ``rows``' positions are computed."""
    from megatron.core import parallel_state as ps
    tp = ps.get_tensor_model_parallel_world_size()
    group = ps.get_tensor_model_parallel_group() if tp > 1 else None
    valid = mb.loss_labels != -100
    if rows is not None:
        keep = torch.zeros(valid.shape[0], dtype=torch.bool, device=valid.device)
        keep[rows] = True
        valid = valid & keep[:, None]
    layout = mb.layout
    teacher, valid = layout.model_view(mb.extras[losses_mod.TEACHER_LOGITS]), layout.model_view(valid)
    vs = head.weight.shape[0] if head is not None else output.shape[-1]
    v0 = vs * ps.get_tensor_model_parallel_rank()
    teacher = teacher[..., v0:v0 + vs]
    if head is not None:
        d = lm_head.fused_jsd(output, head.weight, teacher, valid, beta=beta, temperature=temperature,
                              bias=head.bias, tp_group=group, sequence_parallel=head.sequence_parallel)
    else:
        d = vocab_parallel_jsd(output, teacher, valid, beta=beta, temperature=temperature, group=group)
    d = layout.to_rows(d.float())
    return d if rows is None else d[rows]


def topk_logits(output: torch.Tensor, indices: torch.Tensor, *, head: Optional[lm_head.OutputHead] = None,
                chunk_tokens: Optional[int] = None) -> torch.Tensor:
    """The student's raw logits at ``indices`` [rows, s, k] (global vocabulary ids, the model's
    layout of ``mb.labels``) -> [rows, s, k] fp32, differentiable: from the vocab-parallel
    logits [rows, s, V / tp] (a gather), or with ``head`` from the final hidden states and the
    output weight shard, k rows of the head per token, chunk by chunk
    (:func:`.layers.lm_head.fused_topk_logits`). Each TP rank computes the ids in its vocabulary
    shard; the sum over the TP group is every id's logit."""
    from megatron.core import parallel_state as ps
    tp = ps.get_tensor_model_parallel_world_size()
    group = ps.get_tensor_model_parallel_group() if tp > 1 else None
    if head is not None:
        return lm_head.fused_topk_logits(output, head.weight, indices, bias=head.bias, tp_group=group,
                                         sequence_parallel=head.sequence_parallel, chunk_tokens=chunk_tokens)
    start = output.shape[-1] * ps.get_tensor_model_parallel_rank()
    return vocab_parallel_topk_logits(output, indices, vocab_start=start, group=group)


def token_topk(output, mb, k: int, mask: torch.Tensor, *, temperature: float,
               head: Optional[lm_head.OutputHead] = None) -> Dict[str, torch.Tensor]:
    """``forward_only(return_topk=k)``'s outputs of micro-batch ``mb`` in its row layout:
    ``{'topk_logps': [mbs, S, k] fp32, 'topk_indices': [mbs, S, k] int64}``, the top k of the
    log-softmax at ``temperature`` over the whole vocabulary, sorted descending, 0 / 0 where
    ``mask`` (the loss mask, [mbs, S]) is False. From the vocab-parallel logits
    (:func:`.layers.vocab_parallel.vocab_parallel_topk`) or with ``head`` from the final hidden
    states and the output weight shard, vocabulary chunk by chunk
    (:func:`.layers.lm_head.fused_topk_logps`); each TP rank's top k of its shard, merged over the
    TP group."""
    from megatron.core import parallel_state as ps
    tp = ps.get_tensor_model_parallel_world_size()
    group = ps.get_tensor_model_parallel_group() if tp > 1 else None
    with torch.no_grad():
        if head is not None:
            lp, ids = lm_head.fused_topk_logps(output.detach(), head.weight.detach(), k,
                                               bias=None if head.bias is None else head.bias.detach(),
                                               temperature=temperature, tp_group=group,
                                               sequence_parallel=head.sequence_parallel)
        else:
            start = output.shape[-1] * ps.get_tensor_model_parallel_rank()
            lp, ids = vocab_parallel_topk(output.detach(), k, vocab_start=start, group=group,
                                          temperature=temperature)
        layout = mb.layout
        lp, ids = layout.to_rows(lp.float()), layout.to_rows(ids)
        keep = mask[..., None]
        return {"topk_logps": lp * keep, "topk_indices": ids.masked_fill(~keep, 0)}


def loss_inputs(mb, outputs: TokenOutputs, rows: Optional[torch.Tensor] = None,
                keys: Optional[Tuple[str, ...]] = None) -> losses_mod.LossInputs:
    """The loss's view of micro-batch ``mb`` (a :class:`.batching.MicroBatch`) and its
    ``outputs`` (:func:`token_outputs`); ``rows`` (LongTensor): only those rows, their sequences
    renumbered 0.. in order (what the loss sees when they are sent alone); ``keys``: only those
    per-sample arguments (the student's top-k logits of at most one of them)."""
    logps, entropy, mask = outputs.logps, outputs.entropy, outputs.mask
    extras = {k: v for k, v in mb.extras.items() if keys is None or k in keys}
    divergence = outputs.teacher_divergence if extras.pop(losses_mod.TEACHER_LOGITS, None) is not None else None
    topk = [v for k, v in outputs.student_topk_logits.items() if k in extras]
    if len(topk) > 1:
        raise ValueError("a loss can take the student's logits at one top-k argument, got several")
    topk = topk[0] if topk else None
    segments, num_segments = mb.segments, mb.num_segments
    if rows is not None:
        logps, mask = logps[rows], mask[rows]
        entropy = None if entropy is None else entropy[rows]
        topk = None if topk is None else topk[rows]
        divergence = None if divergence is None else functools.partial(divergence, rows=rows)
        extras = {k: v[rows] for k, v in extras.items()}
        kept, segments = torch.unique(segments[rows], return_inverse=True)
        num_segments = len(kept)
    return losses_mod.LossInputs(
        logps=logps, loss_mask=mask, segment_ids=segments, num_segments=num_segments,
        entropy=entropy, advantages=extras.pop("advantages", None),
        old_logps=extras.pop("old_logps", None), ref_logps=extras.pop("ref_logps", None),
        extras=extras, row_length=mb.row_length, student_topk_logits=topk, teacher_divergence=divergence)


def evaluate(loss, inputs: losses_mod.LossInputs, names: Tuple[str, ...], device, report_here: bool):
    """``loss(inputs)`` checked: ``(loss_sum, count (int tensor), stats)``; ``stats`` float64
    ``[3 + 2 * len(names)]``: loss_sum, count, loss tokens, then sum and count per metric ``names``
    (zeros, as is ``count``, when not ``report_here``)."""
    result = loss(inputs)
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        raise TypeError("a loss must return (loss_sum, count) or (loss_sum, count, metrics)")
    loss_sum, count = result[0], result[1]
    metrics = result[2] if len(result) == 3 else {}
    count = torch.as_tensor(count, device=device)
    if count.is_floating_point():
        if count != count.round():
            raise ValueError(f"a loss's count must be an integer (it divides the summed "
                             f"gradients), got {float(count)}")
    count = count.to(torch.int).reshape([])
    stats = [loss_sum.detach().double().reshape([]), count.double(), inputs.loss_mask.sum().double()]
    for n in names:
        s, c = metrics.get(n, (0.0, 0))
        stats += [torch.as_tensor(s, device=device).detach().double().reshape([]),
                  torch.as_tensor(c, device=device).double().reshape([])]
    stats = torch.stack(stats)
    if not report_here:
        stats = torch.zeros_like(stats)
        count = torch.zeros_like(count)
    return loss_sum, count, stats


def collect_outputs(results: List[dict], key: str, s: int) -> Optional[torch.Tensor]:
    """The micro-batches' row-layout ``key`` tensors -> [B, S, ...] in the user's layout."""
    parts = [r[key] for r in results if key in r]
    if not parts:
        return None
    return unshift(torch.cat([p.cpu() for p in parts], 0), s)


def reduce_results(results: List[dict], width: int, shape, device, *, keep: bool, with_entropy: bool,
                   topk: int = 0):
    """The schedule's per-micro-batch ``results`` -> ``(stats, outputs)`` on every rank: ``stats``
    the [width] float64 sum of their ``'stats'`` over the micro-batches and the DP (and CP) ranks,
    ``outputs`` the [B, S] fp32 ``'logps'`` (with ``keep``) and ``'entropy'`` (with ``keep`` and
    ``with_entropy``) of ``shape`` = (B, S), and with ``topk`` = k the [B, S, k] ``'topk_logps'``
    (fp32) and ``'topk_indices'`` (int64) of :func:`token_topk`; all computed on the last pipeline
    stage and broadcast from it."""
    from megatron.core import parallel_state as ps
    stats = torch.zeros(width, dtype=torch.float64, device=device)
    b, s = shape
    outputs = {k: torch.zeros(b, s, dtype=torch.float32, device=device)
               for k, on in (("logps", keep), ("entropy", keep and with_entropy)) if on}
    if topk:
        outputs["topk_logps"] = torch.zeros(b, s, topk, dtype=torch.float32, device=device)
        outputs["topk_indices"] = torch.zeros(b, s, topk, dtype=torch.int64, device=device)
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        for r in results:
            stats += r["stats"].to(torch.float64)
        dist.all_reduce(stats, group=ps.get_data_parallel_group(with_context_parallel=True))
        for k in outputs:
            outputs[k] = collect_outputs(results, k, s).to(device)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        src = ps.get_pipeline_model_parallel_last_rank()
        for t in [stats, *outputs.values()]:
            dist.broadcast(t, src=src, group=ps.get_pipeline_model_parallel_group())
    return stats, outputs


def read_stats(stats: torch.Tensor, names) -> Tuple[Dict[str, float], Tuple[float, float, int], Dict[str, tuple]]:
    """One loss's reduced statistics (``[loss sum, count, tokens, (metric sum, metric count) per
    name in names]``) -> ``(result, (loss sum, count, tokens), {name: (sum, count)})``; ``result``
    is what forward_backward reports: ``{'loss', 'count', 'num_tokens', <metrics>}``."""
    loss_sum, count, tokens = float(stats[0]), float(stats[1]), int(stats[2])
    pairs = {n: (float(stats[3 + 2 * i]), float(stats[4 + 2 * i])) for i, n in enumerate(names)}
    result = {"loss": loss_sum / count if count else 0.0, "count": count, "num_tokens": tokens,
              **{n: v / c if c else float("nan") for n, (v, c) in pairs.items()}}
    return result, (loss_sum, count, tokens), pairs
