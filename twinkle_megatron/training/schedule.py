"""One call of megatron's pipeline schedule for the facade, and its full-vocabulary logits.

:func:`run` is what ``forward_backward`` / ``forward_only`` run, for a planned :class:`.call.Call`
(one group, or one per adapter of a mixed batch): its micro-batches through
``get_forward_backward_func`` with the one ``forward_step`` of the package, whose loss function
evaluates each group's loss on its rows (:mod:`.loss_step`; and the MoE aux loss of
:mod:`.aux_loss`), then each group's loss statistics reduced over the data-parallel ranks and
broadcast from the last pipeline stage. :func:`logits` is the ``logits()`` forward (pipeline size
1). Both take the :class:`.engine.Engine`; they keep no state of their own.
"""
from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Dict, List, Optional

import torch

from . import aux_loss, loss_step, reduction
from .engine import Engine, TrainState, eval_mode

if TYPE_CHECKING:   # call.py runs this module's run(): no import cycle at run time
    from .call import Call


def run(engine: Engine, call: "Call") -> List[Dict[str, float]]:
    """Run ``call`` through megatron's schedule. Accumulates each group's grads unless
    ``call.forward_only`` (its loss count is added to its state's ``pending_tokens``, finalised
    before its step). Returns per group ``{'loss', 'count', 'num_tokens', <the loss's metrics>}``
    plus ``'logps'`` / ``'entropy'`` ([rows, S] fp32 CPU, its rows) and ``'topk_logps'`` /
    ``'topk_indices'`` ([rows, S, k], ``call.topk``), ``'logits'`` ([rows, S, V] fp32,
    ``call.logits``) and ``'routed_experts'`` ([rows, S, L_moe, k] int64, ``call.routing``
    recording) when asked; the same on every rank. Each group's meter
    records the call. A ``forward_only`` call runs the model in eval mode (dropout off, LoRA's
    included, as megatron's own evaluation does), restored after."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    groups, mesh, device, aux = call.groups, engine.mesh, engine.device, engine.aux
    if aux is not None and len(groups) > 1:
        raise NotImplementedError("the MoE aux loss with several groups in one call")
    single = len(groups) == 1
    report_here = ps.get_context_parallel_rank() == 0
    counts = [torch.zeros([], dtype=torch.int, device=device) for _ in groups]
    recompute = engine.config.recompute_granularity is not None
    router, routing = call.router, call.routing
    wrapped = engine.wrapped(groups[0].state)

    failure = []   # the first exception this rank's loss function raised in this call
    # every group's loss differentiates to one number per loss position: the fused head's gradients
    # can be computed in its forward (checked again in its backward, which recomputes otherwise)
    masked_grad = not call.forward_only and all(getattr(g.loss, "logps_grad_uniform", False) for g in groups)

    def group_losses(mb, head, output):
        """megatron's loss_func: (sum of the groups' unnormalised loss sums, their count, report).
        An exception here (a loss, a user metric) becomes a zero loss so that the schedule's
        sends and receives still pair up across the pipeline stages; after the schedule every rank
        learns of it and raises (:func:`_raise_loss_failure`), and the call is rolled back."""
        if not failure:
            try:
                return checked_group_losses(mb, head, output)
            except Exception as e:  # re-raised after the schedule, on every rank
                failure.append(e)
        return _zero_loss(output, sum(g.width for g in groups), device)

    def checked_group_losses(mb, head, output):
        outputs = loss_step.token_outputs(output, mb, temperature=call.temperature,
                                          with_entropy=call.with_entropy, head=head, argmax=call.argmax,
                                          masked_grad=masked_grad)
        logps, entropy, mask = outputs.logps, outputs.entropy, outputs.mask
        total, stats = None, []
        here = torch.zeros([], dtype=torch.int, device=device)
        for j, g in enumerate(groups):
            rows = None if single else (mb.row_groups == j).nonzero().reshape(-1)
            if rows is not None and not len(rows):
                stats.append(torch.zeros(g.width, dtype=torch.float64, device=device))
                continue
            inputs = loss_step.loss_inputs(mb, outputs, rows, g.keys)
            loss_sum, count, st = reduction.evaluate(g.loss, inputs, g.metric_names, device, report_here)
            total = loss_sum if total is None else total + loss_sum
            counts[j] += count
            here = here + count
            stats.append(st)
        report = {"stats": torch.cat(stats)}
        if call.keep:
            report["logps"] = (logps.detach() * mask).float()
            if entropy is not None:
                report["entropy"] = (entropy.detach() * mask).float()
        if call.topk:
            report.update(loss_step.token_topk(output, mb, call.topk, mask, temperature=call.temperature, head=head))
        if call.logits:
            report["logits"] = loss_step.token_logits(output, mb, head=head)
        return total, here, report

    def forward_step(data_iterator, chunk_module):
        mb = next(data_iterator)
        index = wrapped.index(chunk_module)
        chunk, head = engine.chunks[index], engine.heads[index]
        kw = {"return_hidden_states": True} if head is not None else {}
        stats = None
        if aux is not None:
            kw["padding_mask"] = aux_loss.router_padding(mb.padding_mask, chunk, mesh)
            stats = aux.begin(device)
        if router is not None:
            router.groups = mb.adapter_groups
        if routing is not None:
            routing.before(index, mb)
        output = chunk_module(mb.input_ids, mb.position_ids, None, packed_seq_params=mb.packed_seq_params, **kw)
        if routing is not None:
            output = routing.after(index, mb, output, recompute)
        if router is not None and recompute and output.requires_grad:
            # the layers recomputed in this micro-batch's backward read its groups
            output = router.restore_on_backward(output)
        loss_func = functools.partial(group_losses, mb, head)
        if aux is not None:
            aux.end()
            if not chunk.post_process:
                engine.aux_exchange.send_stats(stats)
            loss_func = aux_loss.with_aux_loss(loss_func, stats, aux.coef,
                                               sequence_parallel=mesh.sequence_parallel,
                                               exchange=engine.aux_exchange, backward=not call.forward_only)
        return output, loss_func

    start = time.perf_counter()
    chunks = len(wrapped)
    iterators = [iter(call.micro_batches) for _ in range(chunks)] if chunks > 1 else iter(call.micro_batches)
    try:
        # forward_only is a measurement (reference / old log-probs, evaluation): no dropout noise in it
        with eval_mode(wrapped, call.forward_only):
            results = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iterators,
                model=wrapped if chunks > 1 else wrapped[0], num_microbatches=len(call.micro_batches),
                seq_length=call.seq_length, micro_batch_size=call.micro_batch_size, forward_only=call.forward_only)
        if not call.forward_only:
            engine.settle_grads([g.state for g in groups])
        _raise_loss_failure(failure[0] if failure else None)
        routed = routing.result() if routing is not None and routing.record else None
    finally:
        if routing is not None:
            routing.reset()
    if aux is not None and engine.aux_exchange is not None:
        engine.aux_exchange.wait()
    drop_routing_graphs(engine.chunks)
    if not call.forward_only:
        for g, c in zip(groups, counts):
            st = g.state
            st.pending_tokens = c.clone() if st.pending_tokens is None else st.pending_tokens + c
            st.has_grads = True
            st.consumed_train_samples += g.samples
    extra = ("aux_loss",) if aux is not None else ()
    widths = [g.width + 2 * len(extra) for g in groups]
    max_at = [p for j, g in enumerate(groups)
              for p in reduction.max_positions(g.metric_names, g.max_names, sum(widths[:j]))]
    stats, outputs = reduction.reduce_results(results, sum(widths), call.shape, device,
                                              keep=call.keep, with_entropy=call.with_entropy, topk=call.topk,
                                              logits_vocab=engine.shape.vocab_size if call.logits else 0,
                                              max_at=max_at)
    elapsed = time.perf_counter() - start
    out, at = [], 0
    for g, width in zip(groups, widths):
        part, at = stats[at:at + width], at + width
        res, totals, pairs = reduction.read_stats(part, g.metric_names + extra, g.max_names, g.total_names)
        g.meter.add_fb(*totals, elapsed, pairs, max_names=g.max_names, total_names=g.total_names)
        rows = slice(None) if single else g.rows
        res.update({k: v[rows].cpu() for k, v in outputs.items()})
        if routed is not None:
            res["routed_experts"] = routed[rows]
        out.append(res)
    return out


def _zero_loss(output: torch.Tensor, width: int, device):
    """A micro-batch's loss_func result after a loss failure on this rank: zero loss (its gradient
    zero, still sent to the earlier stages), zero count, zero stats."""
    loss = output.sum() * 0.0 if output.requires_grad else output.new_zeros([])
    return (loss, torch.zeros([], dtype=torch.int, device=device),
            {"stats": torch.zeros(width, dtype=torch.float64, device=device)})


def _raise_loss_failure(error: Optional[BaseException]) -> None:
    """Collective over every rank of the call: if a rank's loss function raised (under pipeline
    parallelism only the last stage runs it; a user metric may fail on one data-parallel rank),
    every rank raises, the failing one its own exception, the others a RuntimeError naming it;
    the facade's transaction then rolls the call back on each rank. Without this, the other
    ranks would wait in the next collective until the timeout."""
    from .. import validate
    from ..parallel.mesh import facade_group
    validate.agree(error, "this call (its loss function raised; the call was rolled back on every rank)",
                   group=facade_group())


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
def logits(engine: Engine, state: TrainState, ids: torch.Tensor, position_ids: Optional[torch.Tensor]) -> torch.Tensor:
    """Full-vocabulary fp32 logits [B, S, V] (CPU) of the model (pipeline size 1) as ``state``
    runs it, for the validated ``ids`` [B, S]; packed rows (``position_ids`` restarting at 0) run as one THD
    row. Collective over the TP group."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from ..packing import cu_seqlens, extend, is_packed, packed_seq_params
    mesh, device = engine.mesh, engine.device
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
    module = engine.wrapped(state)[0]
    with eval_mode([module]):
        out = module(ids, pos, None, packed_seq_params=packed)
    out = gather_from_tensor_model_parallel_region(out.float())
    return out[:, :n].reshape(b, s, -1).cpu()
