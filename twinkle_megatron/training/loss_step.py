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
The arguments are prepared by :mod:`.arguments`; the loss's results are reduced by
:mod:`.reduction`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Dict, Optional, Tuple

import torch

from . import losses as losses_mod
from .layout import GatherContextParallel  # noqa: F401 (its home was here)
from ..layers import lm_head
from ..layers.vocab_parallel import (vocab_parallel_jsd, vocab_parallel_logps, vocab_parallel_topk,
                                     vocab_parallel_topk_logits)


def token_logps(output: torch.Tensor, target: torch.Tensor, *, temperature: float, with_entropy: bool,
                head: Optional[lm_head.OutputHead] = None, expected_grad: Optional[torch.Tensor] = None):
    """(logps, entropy | None), each shaped like ``target`` [rows, s], from the model's output on
    the last pipeline stage: vocab-parallel logits [rows, s, V / tp], or with ``head`` (the fused
    linear cross-entropy path) the final hidden states [s(/ tp), rows, H] and the output layer's
    weight shard (:func:`.layers.lm_head.fused_token_logps`, which takes ``expected_grad``, the
    logps' gradient up to a scalar when the loss is known to give one; the logits path ignores it).

    The one place per-token outputs are produced."""
    from megatron.core import parallel_state as ps
    tp = ps.get_tensor_model_parallel_world_size()
    group = ps.get_tensor_model_parallel_group() if tp > 1 else None
    if head is not None:
        return lm_head.fused_token_logps(output, head.weight, target, bias=head.bias, temperature=temperature,
                                         with_entropy=with_entropy, tp_group=group,
                                         sequence_parallel=head.sequence_parallel, expected_grad=expected_grad)
    start = output.shape[-1] * ps.get_tensor_model_parallel_rank()
    return vocab_parallel_logps(output, target, vocab_start=start, group=group,
                                temperature=temperature, with_entropy=with_entropy)


def shift_like_labels(t: torch.Tensor, pad: int = 0, fill: float = 0.0) -> torch.Tensor:
    """User layout [B, S, ...] -> the internal one [B, S + pad, ...]: column t holds user column t + 1."""
    b = t.shape[0]
    return torch.cat([t[:, 1:], t.new_full((b, 1 + pad, *t.shape[2:]), fill)], 1)


@dataclasses.dataclass
class TokenOutputs:
    """What the loss step computes from the model's output for one micro-batch, in its rows:
    ``logps`` [mbs, S] fp32, ``entropy`` [mbs, S] fp32 or None, ``mask`` [mbs, S] bool (the loss
    positions), ``student_topk_logits`` {argument: [mbs, S, k] fp32} (the student's raw logits at
    the ids of each of the micro-batch's ``student_topk`` arguments, :func:`topk_logits`), and
    ``teacher_divergence`` (with a ``teacher_logits`` argument: ``f(beta, temperature, rows=None)``,
    :func:`teacher_divergence`; else None), ``argmax_correct`` ([mbs, S] bool: the label is the
    argmax of the model's distribution at that loss position; with ``argmax``, else None)."""
    logps: torch.Tensor
    entropy: Optional[torch.Tensor]
    mask: torch.Tensor
    student_topk_logits: Dict[str, torch.Tensor]
    teacher_divergence: Optional[Callable] = None
    argmax_correct: Optional[torch.Tensor] = None


def token_outputs(output, mb, *, temperature: float, with_entropy: bool,
                  head: Optional[lm_head.OutputHead] = None, argmax: bool = False,
                  masked_grad: bool = False) -> TokenOutputs:
    """The :class:`TokenOutputs` of micro-batch ``mb`` (a :class:`.batching.MicroBatch`) in its row
    layout, from the model's output (see :func:`token_logps`); ``argmax``: also
    ``argmax_correct``, from the top 1 of the whole vocabulary (:func:`token_topk`);
    ``masked_grad``: the loss's gradient of the logps is one number at every loss position and 0
    elsewhere (:attr:`.losses.Loss.logps_grad_uniform`), which lets the fused head compute its
    gradients in the forward."""
    # -mask: a token-sum NLL's own gradient, so that the usual backward (an incoming 1.0) finds the
    # scale 1 and the head's gradients are handed over unscaled (no pass over the [V, H] weight's)
    expected = -(mb.labels >= 0).float() if masked_grad and head is not None else None
    logps, entropy = token_logps(output, mb.labels.clamp(min=0), temperature=temperature,
                                 with_entropy=with_entropy, head=head, expected_grad=expected)
    layout = mb.layout
    topk = {n: layout.to_rows(topk_logits(output, layout.model_view(mb.extras[n]), head=head))
            for n in mb.student_topk}
    divergence = None
    if losses_mod.TEACHER_LOGITS in mb.extras:     # GKD's full-vocabulary teacher: the loss asks
        divergence = functools.partial(teacher_divergence, output, mb, head)
    mask = mb.loss_labels != -100
    correct = None
    if argmax:   # the argmax does not depend on the temperature
        top = token_topk(output, mb, 1, mask, temperature=1.0, head=head)["topk_indices"][..., 0]
        correct = (top == mb.loss_labels) & mask
    return TokenOutputs(logps=layout.to_rows(logps), entropy=None if entropy is None else layout.to_rows(entropy),
                        mask=mask, student_topk_logits=topk, teacher_divergence=divergence,
                        argmax_correct=correct)


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


def token_logits(output, mb, *, head: Optional[lm_head.OutputHead] = None) -> torch.Tensor:
    """``return_logits=True``'s logits of micro-batch ``mb`` in its row layout: [mbs, S_mb, V] fp32
    (float64 for float64 weights), position t the model's logits after the tokens up to t (the
    ones ``logps`` are read from, before the temperature), no gradient. From the vocab-parallel
    logits [rows, s, V / tp], or with ``head`` from the final hidden states [s(/ tp), rows, H]
    times the output weight shard; gathered over the TP group's vocabulary shards (and the
    sequence under sequence parallelism), then over the CP ranks' positions by the layout."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    tp = ps.get_tensor_model_parallel_world_size()
    group = ps.get_tensor_model_parallel_group() if tp > 1 else None
    with torch.no_grad():
        if head is not None:
            hidden = output.detach()
            if head.sequence_parallel and tp > 1:
                from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
                hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False, group=group)
            dtype = torch.float64 if head.weight.dtype == torch.float64 else torch.float32
            z = hidden.to(dtype) @ head.weight.detach().to(dtype).T
            if head.bias is not None:
                z = z + head.bias.detach().to(dtype)
            z = z.transpose(0, 1)
        else:
            z = output.detach()
            z = z.to(torch.float64 if z.dtype == torch.float64 else torch.float32)
        if tp > 1:
            z = gather_from_tensor_model_parallel_region(z.contiguous(), group=group)
        return mb.layout.to_rows(z.contiguous())


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
    logps, entropy, mask, correct = outputs.logps, outputs.entropy, outputs.mask, outputs.argmax_correct
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
        correct = None if correct is None else correct[rows]
        topk = None if topk is None else topk[rows]
        divergence = None if divergence is None else functools.partial(divergence, rows=rows)
        extras = {k: v[rows] for k, v in extras.items()}
        kept, segments = torch.unique(segments[rows], return_inverse=True)
        num_segments = len(kept)
    return losses_mod.LossInputs(
        logps=logps, loss_mask=mask, segment_ids=segments, num_segments=num_segments,
        entropy=entropy, advantages=extras.pop("advantages", None),
        old_logps=extras.pop("old_logps", None), ref_logps=extras.pop("ref_logps", None),
        extras=extras, row_length=mb.row_length, student_topk_logits=topk, teacher_divergence=divergence,
        argmax_correct=correct)
