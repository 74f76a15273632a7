"""One call of megatron's pipeline schedule for the facade, and its full-vocabulary logits.

:func:`run_schedule` is what ``forward_backward`` / ``forward_only`` run: the micro-batches
(:mod:`.batching`) through ``get_forward_backward_func`` with the loss function of
:mod:`.loss_step` (and the MoE aux loss of :mod:`.aux_loss`), then the loss statistics reduced over
the data-parallel ranks and broadcast from the last pipeline stage. :func:`logits` is the
``logits()`` forward (pipeline size 1). Both take the facade (``MegatronModel``) for its chunks,
mesh and settings; they keep no state of their own.
"""
from __future__ import annotations

import time
from typing import Dict, Optional

import torch

from ..layers import lm_head
from . import aux_loss, loss_step, metrics


def run_schedule(model, batch, micro_batch_size, *, forward_only: bool, meter, loss, args,
                 return_logps: bool, return_entropy: bool, temperature: float) -> Dict[str, float]:
    """Run ``batch`` (a dict of [B, S] tensors, this rank's share) through the schedule of
    ``model`` (the facade) with ``loss``; ``args`` are the loss's per-sample arguments.
    Accumulates grads unless ``forward_only``. Returns ``{'loss', 'count', 'num_tokens',
    <the loss's metrics>}`` plus ``'logps'`` / ``'entropy'`` ([B, S] fp32 CPU) when asked; the
    same on every rank. ``meter`` (:class:`.metrics.Meter`) records the call."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    mesh, device, aux = model.mesh, model.device, model._aux
    mbs_list, mbs, seq = model._micro_batches(batch, micro_batch_size, args)
    if model._user_metrics:
        loss = metrics.WithMetrics(loss, model._user_metrics)
    start = time.perf_counter()
    with_entropy = bool(return_entropy or getattr(loss, "needs_entropy", False))
    keep = bool(return_logps or return_entropy)
    report_here = ps.get_context_parallel_rank() == 0
    wrapped = model.model

    def forward_step(data_iterator, chunk_module):
        mb = next(data_iterator)
        chunk = model._chunks[wrapped.index(chunk_module)]
        head = lm_head.output_head(chunk) if model.fused_linear_ce and chunk.post_process else None
        kw = {"return_hidden_states": True} if head is not None else {}
        if aux is not None:
            kw["padding_mask"] = aux_loss.router_padding(mb["padding_mask"], chunk, mesh)
        stats = None if aux is None else aux.begin(device)
        output = chunk_module(mb["input_ids"], mb["position_ids"], None,
                              packed_seq_params=mb.get("packed_seq_params"), **kw)
        loss_func = loss_step.make_loss_func(
            loss, mb, temperature=temperature, with_entropy=with_entropy, keep_outputs=keep,
            report_here=report_here, device=device, head=head)
        if aux is not None:
            aux.end()
            if not chunk.post_process:
                model._aux_exchange.send_stats(stats)
            loss_func = aux_loss.with_aux_loss(loss_func, stats, aux.coef,
                                               sequence_parallel=mesh.sequence_parallel,
                                               exchange=model._aux_exchange, backward=not forward_only)
        return output, loss_func

    chunks = len(wrapped)
    iterators = [iter(mbs_list) for _ in range(chunks)] if chunks > 1 else iter(mbs_list)
    results = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iterators,
        model=wrapped if chunks > 1 else wrapped[0], num_microbatches=len(mbs_list),
        seq_length=seq, micro_batch_size=mbs, forward_only=forward_only)
    if aux is not None and model._aux_exchange is not None:
        model._aux_exchange.wait()
    drop_routing_graphs(model._chunks)
    names = loss_step.metric_names(loss) + (("aux_loss",) if aux is not None else ())
    stats, outputs = loss_step.reduce_results(results, 3 + 2 * len(names), batch["input_ids"].shape,
                                              device, keep=keep, with_entropy=with_entropy)
    out, totals, pairs = loss_step.read_stats(stats, names)
    meter.add_fb(*totals, time.perf_counter() - start, pairs)
    out.update({k: v.cpu() for k, v in outputs.items()})
    return out


def drop_routing_graphs(chunks) -> None:
    """Let go of the routing probabilities megatron's token dispatchers keep from their last
    forward (``probs`` [tokens, E]; nothing reads them once the MoE layer's forward is done, the
    backward runs on the autograd graph itself). Kept, their graph reaches the router weight's
    grad accumulator, whose DDP hook holds the wrapped model: a cycle through autograd's C++
    nodes, which Python's gc cannot see, so a dropped MoE ``MegatronModel`` was never freed
    (Qwen3.5-MoE text cut to 2 layers: 2.7 GB per rank stayed resident after ``del model``)."""
    for chunk in chunks:
        for module in chunk.modules():
            dispatcher = getattr(module, "token_dispatcher", None)
            if getattr(dispatcher, "probs", None) is not None:
                dispatcher.probs = None


@torch.no_grad()
def logits(model, ids: torch.Tensor, position_ids: Optional[torch.Tensor]) -> torch.Tensor:
    """Full-vocabulary fp32 logits [B, S, V] (CPU) of ``model`` (the facade, pipeline size 1) for
    the validated ``ids`` [B, S]; packed rows (``position_ids`` restarting at 0) run as one THD
    row. Collective over the TP group."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from ..packing import cu_seqlens, extend, is_packed, packed_seq_params
    mesh, device = model.mesh, model.device
    ids = ids.long()
    b, s = ids.shape
    cu = cu_seqlens(position_ids) if is_packed(position_ids) else None
    if cu is not None:  # one THD row of all tokens
        ids = ids.reshape(1, -1)
    rows, n = ids.shape
    pad = (-n) % (mesh.tp_size if mesh.sequence_parallel else 1)
    ids = torch.cat([ids, ids.new_zeros((rows, pad))], 1).to(device)
    # megatron's RoPE takes positions from the token index (or, packed, from cu_seqlens)
    pos = torch.arange(n + pad, device=device).expand(rows, -1)
    packed = None if cu is None else packed_seq_params(extend(cu, n + pad), device)
    module = model.model[0]
    was_training = module.training
    module.eval()
    try:
        out = module(ids, pos, None, packed_seq_params=packed)
    finally:
        module.train(was_training)
    out = gather_from_tensor_model_parallel_region(out.float())
    return out[:, :n].reshape(b, s, -1).cpu()
