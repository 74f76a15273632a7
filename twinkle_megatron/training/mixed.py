"""Mixed batches: several adapters' rows in one pass of the base model (``forward_backward(...,
adapter_names=[...])``), each adapter getting exactly the gradient it would get from its rows
alone.

Why it is exact: a row's tokens only ever meet tokens of the same row (attention is per row, or
per packed sample), so adapter ``a``'s parameters influence only ``a``'s rows. Backpropagating the
sum of every adapter's *unnormalised* loss sum therefore gives each adapter's parameters its own
gradient sum. Each adapter keeps its own pending normaliser (the count its loss reports, summed
over micro-batches and calls), and its own DDP wrap (:mod:`twinkle_megatron.lora.tenants`) holds its own grad buffer:
megatron's DDP hooks sit on the parameters that required grad when that wrap was made, so with
several adapters trainable in one backward each gradient lands in its owner's buffer, and each
adapter's ``clip_grad_and_step`` finalises (DP reduce, ``1 / count``) only its own.

The LoRA side (the names checked, the grouped deltas in every adapted linear) is the ``hooks``
class the facade passes in (:class:`twinkle_megatron.lora.mixed.MixedRun`); this module runs the
schedule: the batch split per adapter, one loss per micro-batch (the sum of its adapters'
unnormalised loss sums), each adapter's count kept for its own finalise, results per adapter.

With activation recompute, each chunk's output passes a node whose backward makes its
micro-batch's adapter index current again (:meth:`MixedRun.restore_on_backward`): under pipeline
parallelism the schedule interleaves backwards with other micro-batches' forwards, and a layer
recomputed in a backward must read its own micro-batch's index.

Refused, with the reason: fp16 (one loss scale per adapter's optimizer, but one backward), the MoE
aux loss (it mixes every row's router statistics), ``overlap_grad_reduce`` (every adapter's wrap
would launch reductions in the one backward). Adapters on routed experts train mixed
too: the hooks carry each token's adapter index through the MoE token dispatcher
(:mod:`twinkle_megatron.lora.mixed_experts`, which also names what it refuses).
"""
from __future__ import annotations

import functools
import time
from typing import Dict, List

import torch
import torch.distributed as dist

from ..layers import lm_head
from . import batching, loss_step, metrics, schedule


def _row_arguments(value, rows: List[int]):
    if torch.is_tensor(value) or hasattr(value, "shape"):
        return torch.as_tensor(value)[rows]
    return [value[i] for i in rows]


def prepare(model, batch, names: List[str], loss_kwargs: dict) -> Dict[str, tuple]:
    """Per adapter: ``(rows, its loss arguments [B_a, S] fp32)``; each argument goes to the adapters
    whose loss takes it (sliced to their rows), as if their rows had been sent alone."""
    per, used = {}, set()
    for n in dict.fromkeys(names):
        rows = [i for i, m in enumerate(names) if m == n]
        loss = model._states[n].loss
        accepts = tuple(getattr(loss, "accepts", ()))
        kwargs = {k: _row_arguments(v, rows) for k, v in loss_kwargs.items() if k in accepts and v is not None}
        used.update(kwargs)
        sub = {k: v[rows] for k, v in batch.items()}
        per[n] = (rows, model._loss_arguments(loss, sub, kwargs, strict=True))
    unused = sorted(k for k, v in loss_kwargs.items() if v is not None and k not in used)
    if unused:
        raise TypeError(f"forward_backward: no adapter in adapter_names has a loss that takes {unused}")
    return per


def refuse_unsupported(model) -> None:
    if model.dtype == torch.float16:
        raise NotImplementedError("adapter_names= with mixed_precision='fp16': each adapter's optimizer "
                                  "has its own loss scale, a mixed batch has one backward; use bf16 or fp32")
    if model._aux is not None:
        raise NotImplementedError("adapter_names= with the MoE aux loss on: the load-balancing loss mixes "
                                  "every row's router statistics; set router_aux_loss_coef=0 or send each "
                                  "adapter's rows with adapter_name=")
    if model._active is not None:
        raise RuntimeError("forward_backward cannot run inside another call")
    if model.overlap.overlap_grad_reduce:
        raise NotImplementedError("adapter_names= with overlap_grad_reduce=True: each adapter's DDP wrap "
                                  "would launch its own bucket reductions inside the one backward; "
                                  "turn overlap_grad_reduce off for mixed batches")


def _token_groups(mb: dict, row_groups: torch.Tensor, device) -> torch.Tensor:
    """The adapter index of the tokens the model sees for micro-batch ``mb``: ``[1, mbs]`` for
    plain rows (every position of a row is its row's), ``[T, 1]`` for a packed THD row (-1 on the
    padding after the last sample)."""
    if mb["layout"]["kind"] == "packed":
        mbs, s = mb["layout"]["rows"]
        pad = mb["input_ids"].shape[1] - mbs * s
        g = torch.cat([row_groups.repeat_interleave(s), row_groups.new_full((pad,), -1)])
        return g[:, None].to(device)
    return row_groups[None, :].to(device)


def forward_backward(model, hooks, *, inputs, adapter_names, micro_batch_size, return_logps: bool,
                     return_entropy: bool, temperature: float, loss_kwargs: dict) -> Dict[str, dict]:
    """See :meth:`MegatronModel.forward_backward` (``adapter_names``); ``hooks``: the LoRA side
    (:class:`twinkle_megatron.lora.mixed.MixedRun`). Returns ``{adapter name:
    its result}`` for every adapter with rows in the batch on any data-parallel rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    refuse_unsupported(model)
    held = {}

    def check(batch):
        names = hooks.check_names(model, adapter_names, len(batch["input_ids"]))
        held["names"], held["per"] = names, prepare(model, batch, names, loss_kwargs)
        return held["per"]

    batch, per = model._checked_batch(inputs, micro_batch_size, loss_check=check)
    names_here = held["names"]
    # the adapters of this call: those with rows on any DP rank (the same list on every rank)
    everyone = list(model.adapters)
    rows_of = torch.tensor([float(names_here.count(n)) for n in everyone], dtype=torch.float64, device=model.device)
    if ps.get_data_parallel_world_size() > 1:
        dist.all_reduce(rows_of, group=ps.get_data_parallel_group())
    names = [n for n, c in zip(everyone, rows_of.tolist()) if c > 0]
    index = {n: i for i, n in enumerate(names)}
    row_groups = torch.tensor([index[n] for n in names_here], dtype=torch.long)

    # each adapter's ignore_index is applied here, so one label convention (-100) runs below
    labels = batch["labels"].clone()
    keys = {}
    full_args = {}
    b, s = batch["input_ids"].shape
    for n, (rows, args) in per.items():
        ignore = getattr(model._states[n].loss, "ignore_index", -100)
        if ignore != -100:
            labels[rows] = labels[rows].masked_fill(labels[rows] == ignore, -100)
        keys[n] = tuple(args)
        for k, v in args.items():
            full_args.setdefault(k, torch.zeros(b, s, dtype=torch.float32))[rows] = v.float()
    batch = dict(batch, labels=labels)
    mbs_list, mbs, seq = batching.micro_batches(model.mesh, model.device, batch, micro_batch_size, full_args)
    for i, mb in enumerate(mbs_list):
        rows = mb["loss_labels"].shape[0]      # of the user's batch, in order
        mine = row_groups[i * rows:(i + 1) * rows]
        mb["row_groups"], mb["adapter_groups"] = mine.to(model.device), _token_groups(mb, mine, model.device)

    states = {n: model._states[n] for n in names}
    the_losses = {n: (metrics.WithMetrics(st.loss, st.user_metrics) if st.user_metrics else st.loss)
                  for n, st in states.items()}
    metric_names = {n: loss_step.metric_names(the_losses[n]) for n in names}
    widths = [3 + 2 * len(metric_names[n]) for n in names]
    with_entropy = bool(return_entropy or any(getattr(l, "needs_entropy", False) for l in the_losses.values()))
    keep = bool(return_logps or return_entropy)
    report_here = ps.get_context_parallel_rank() == 0
    device = model.device
    counts = [torch.zeros([], dtype=torch.int, device=device) for _ in names]

    def loss_func(mb, head, output):
        logps, entropy, mask = loss_step.token_outputs(output, mb, temperature=temperature,
                                                       with_entropy=with_entropy, head=head)
        total, stats, here = None, [], torch.zeros([], dtype=torch.int, device=device)
        for j, n in enumerate(names):
            rows = (mb["row_groups"] == j).nonzero().reshape(-1)
            if not len(rows):
                stats.append(torch.zeros(widths[j], dtype=torch.float64, device=device))
                continue
            inputs_j = loss_step.loss_inputs(mb, logps, entropy, mask, rows, keys.get(n, ()))
            loss_sum, count, st = loss_step.evaluate(the_losses[n], inputs_j, metric_names[n], device, report_here)
            total = loss_sum if total is None else total + loss_sum
            counts[j] += count
            here = here + count
            stats.append(st)
        report = {"stats": torch.cat(stats)}
        if keep:
            report["logps"] = (logps.detach() * mask).float()
            if entropy is not None:
                report["entropy"] = (entropy.detach() * mask).float()
        # megatron adds up the counts for its finalize, which is replaced here by one per adapter
        return total, here, report

    run = hooks(model, names)
    recompute = model.config.recompute_granularity is not None
    model._active = states[names[0]]
    try:
        hooks.activate(model.adapters, index)
        wrapped = model.model
        model.config.finalize_model_grads_func = lambda *a, **k: None   # each adapter's count, below

        def forward_step(data_iterator, chunk_module):
            mb = next(data_iterator)
            chunk = model._chunks[wrapped.index(chunk_module)]
            head = lm_head.output_head(chunk) if model.fused_linear_ce and chunk.post_process else None
            kw = {"return_hidden_states": True} if head is not None else {}
            run.groups = mb["adapter_groups"]
            output = chunk_module(mb["input_ids"], mb["position_ids"], None,
                                  packed_seq_params=mb.get("packed_seq_params"), **kw)
            if recompute and output.requires_grad:
                # the layers recomputed in this micro-batch's backward read its index
                output = run.restore_on_backward(output)
            return output, functools.partial(loss_func, mb, head)

        start = time.perf_counter()
        chunks = len(wrapped)
        iterators = [iter(mbs_list) for _ in range(chunks)] if chunks > 1 else iter(mbs_list)
        results = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iterators,
            model=wrapped if chunks > 1 else wrapped[0], num_microbatches=len(mbs_list),
            seq_length=seq, micro_batch_size=mbs, forward_only=False)
        schedule.drop_routing_graphs(model._chunks)   # as run_schedule: else a MoE model is never freed
        elapsed = time.perf_counter() - start
    finally:
        run.remove(model.adapters)
        model._active = None
        model.config.finalize_model_grads_func = model._defer_finalize
    for n, c in zip(names, counts):
        st = states[n]
        st.pending_tokens = c.clone() if st.pending_tokens is None else st.pending_tokens + c
        st.has_grads = True
        st.consumed_train_samples += int(rows_of[everyone.index(n)])
    return _report(model, names, per, results, widths, metric_names, keep, with_entropy, batch, elapsed)


def _report(model, names, per, results, widths, metric_names, keep, with_entropy, batch, elapsed):
    """Per adapter: its loss statistics over every DP rank (as :func:`..training.schedule.run_schedule`
    reports them) and its rows' logps / entropy when asked; recorded in its training meter."""
    stats, outputs = loss_step.reduce_results(results, sum(widths), batch["input_ids"].shape, model.device,
                                              keep=keep, with_entropy=with_entropy)
    out, at = {}, 0
    for n, width in zip(names, widths):
        part, at = stats[at:at + width], at + width
        res, totals, pairs = loss_step.read_stats(part, metric_names[n])
        model._states[n].metric.add_fb(*totals, elapsed, pairs)
        rows = per[n][0] if n in per else []
        res.update({k: v[rows].cpu() for k, v in outputs.items()})
        out[n] = res
    return out
