"""The reduction of a call's outputs: each micro-batch's loss evaluated into a row of statistics
(:func:`evaluate`), the rows summed over micro-batches and data/context-parallel ranks and
broadcast from the last pipeline stage with the per-token outputs (:func:`reduce_results`), and
read back into what ``forward_backward`` reports (:func:`read_stats`)."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import losses as losses_mod


def metric_names(loss) -> Tuple[str, ...]:
    return tuple(getattr(loss, "metric_names", ()))


def max_metric_names(loss) -> frozenset:
    """The names among ``metric_names`` reduced by their maximum, not summed (``max_metric_names``
    of the loss: maxima of quantities >= 0, their count still summed)."""
    return frozenset(getattr(loss, "max_metric_names", ()))


def total_metric_names(loss) -> frozenset:
    """The names among ``metric_names`` reported as their sum, not the sum over the count
    (``total_metric_names`` of the loss: totals such as a token count; summed like the others)."""
    return frozenset(getattr(loss, "total_metric_names", ()))


def max_positions(names, max_names, offset: int = 0) -> List[int]:
    """The positions in a statistics row (:func:`evaluate`, starting at ``offset``) of the values
    of ``max_names`` among ``names``."""
    return [offset + 3 + 2 * i for i, n in enumerate(names) if n in max_names]


def unshift(x: torch.Tensor, s: int) -> torch.Tensor:
    """Internal [B, >= S, ...] -> user layout [B, S, ...]: user column t + 1 from internal column
    t, 0 at 0."""
    out = x.new_zeros(x.shape[0], s, *x.shape[2:])
    out[:, 1:] = x[:, :s - 1]
    return out


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
                   topk: int = 0, logits_vocab: int = 0, max_at: Sequence[int] = ()):
    """The schedule's per-micro-batch ``results`` -> ``(stats, outputs)`` on every rank: ``stats``
    the [width] float64 sum of their ``'stats'`` over the micro-batches and the DP (and CP) ranks,
    the entries at ``max_at`` (:func:`max_positions`) their maximum instead, ``outputs`` the [B, S]
    fp32 ``'logps'`` (with ``keep``) and ``'entropy'`` (with ``keep`` and
    ``with_entropy``) of ``shape`` = (B, S), and with ``topk`` = k the [B, S, k] ``'topk_logps'``
    (fp32) and ``'topk_indices'`` (int64) of :func:`token_topk`, with ``logits_vocab`` = V the
    [B, S, V] fp32 ``'logits'`` (:func:`.loss_step.token_logits`: position t the model's output
    at t, not shifted); all computed on the last pipeline stage and broadcast from it."""
    from megatron.core import parallel_state as ps
    stats = torch.zeros(width, dtype=torch.float64, device=device)
    b, s = shape
    outputs = {k: torch.zeros(b, s, dtype=torch.float32, device=device)
               for k, on in (("logps", keep), ("entropy", keep and with_entropy)) if on}
    if topk:
        outputs["topk_logps"] = torch.zeros(b, s, topk, dtype=torch.float32, device=device)
        outputs["topk_indices"] = torch.zeros(b, s, topk, dtype=torch.int64, device=device)
    if logits_vocab:
        outputs["logits"] = torch.zeros(b, s, logits_vocab, dtype=torch.float32, device=device)
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        group = ps.get_data_parallel_group(with_context_parallel=True)
        is_max = torch.zeros(width, dtype=torch.bool, device=device)
        is_max[list(max_at)] = True
        for r in results:
            st = r["stats"].to(torch.float64)
            stats = torch.where(is_max, torch.maximum(stats, st), stats + st)
        if max_at:
            top = stats.clone()
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            dist.all_reduce(stats, group=group)
            stats = torch.where(is_max, top, stats)
        else:
            dist.all_reduce(stats, group=group)
        for k in outputs:
            if k == "logits":   # the model's positions: no shift
                outputs[k] = torch.cat([r[k][:, :s].float().cpu() for r in results], 0).to(device)
            else:
                outputs[k] = collect_outputs(results, k, s).to(device)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        src = ps.get_pipeline_model_parallel_last_rank()
        for t in [stats, *outputs.values()]:
            dist.broadcast(t, src=src, group=ps.get_pipeline_model_parallel_group())
    return stats, outputs


def read_stats(stats: torch.Tensor, names, max_names=frozenset(), total_names=frozenset()
               ) -> Tuple[Dict[str, float], Tuple[float, float, int], Dict[str, tuple]]:
    """One loss's reduced statistics (``[loss sum, count, tokens, (metric sum, metric count) per
    name in names]``) -> ``(result, (loss sum, count, tokens), {name: (sum, count)})``; ``result``
    is what forward_backward reports: ``{'loss', 'count', 'num_tokens', <metrics>}``, each metric
    its sum over its count (its maximum for ``max_names``, its sum for ``total_names``; NaN with a
    count of 0)."""
    loss_sum, count, tokens = float(stats[0]), float(stats[1]), int(stats[2])
    pairs = {n: (float(stats[3 + 2 * i]), float(stats[4 + 2 * i])) for i, n in enumerate(names)}
    result = {"loss": loss_sum / count if count else 0.0, "count": count, "num_tokens": tokens,
              **{n: (v if n in max_names or n in total_names else v / c) if c else float("nan")
                 for n, (v, c) in pairs.items()}}
    return result, (loss_sum, count, tokens), pairs
