"""The MoE load-balancing (aux) loss of transformers' Qwen3-MoE / Qwen3.5-MoE, on megatron's routers.

transformers (``load_balancing_loss_func``, used when ``output_router_logits`` is on) pools the
routing of **all layers** of one forward before it multiplies::

    aux = E * sum_e f_e * P_e
    f_e = #{(token, layer, top-k slot) routed to e} / (L * T)
    P_e = sum_{token, layer} softmax(router_logits)_e / (L * T)

with ``E`` experts, ``L`` MoE layers, ``T`` counted tokens (``attention_mask`` 1; all tokens when
there is no mask), the softmax over all experts (before top-k) and no ``1 / top_k``. The model
adds ``router_aux_loss_coef * aux`` to the batch's mean cross entropy. Because f and P are summed
over layers first, cross-layer products ``f_{l,e} P_{m,e}`` count: this is not the mean of
per-layer losses that megatron's ``aux_loss`` / ``global_aux_loss`` / ``seq_aux_loss`` compute
(those also carry a ``1 / top_k`` and their own per-layer normalisation), so they stay off and
this module replaces them:

- :func:`router_class` (:mod:`twinkle_megatron.layers.router`) is megatron's ``TopKRouter`` (chosen in the layer spec) that, while a
  micro-batch is being collected, adds each layer's additive statistics to one
  :class:`RoutingStats`: routed counts per expert, summed probabilities per expert, counted rows.
  Tokens marked by megatron's ``padding_mask`` (the facade's SP / CP / packing padding and the
  user's ``attention_mask`` zeros) are left out, as transformers leaves out ``attention_mask``
  zeros.
- At the micro-batch's loss (after every layer ran), :meth:`RoutingStats.finish` sums the
  statistics over every rank that holds other tokens of the micro-batch (data, context and, with
  sequence parallelism, tensor parallel ranks; expert parallel ranks are data-parallel ranks), so
  the value does not depend on the layout, and fixes the gradient of the loss with respect to
  each layer's summed probabilities: ``d aux / d P^{local}_{l,e} = E * C_e / R**2`` (``C`` the
  pooled counts, ``R`` the pooled rows; the counts carry no gradient, as in transformers).
- :class:`PooledAuxGrad` hands that gradient to each layer's router in the backward, scaled
  like the main loss (megatron's ``MoEAuxLossAutoScaler.main_loss_backward_scale``: fp16's loss
  scale).

Micro-batches and accumulation: transformers computes the aux loss per forward. Here it is
computed per micro-batch, pooled over the micro-batch's rows on all data-parallel ranks (the
i-th micro-batch of every DP rank together), and weighted by that micro-batch's share of the
loss's count, so the step minimises::

    (sum_i loss_sum_i + coef * sum_i count_i * aux_i) / sum_i count_i

With one micro-batch per step this is exactly transformers' ``loss + coef * aux`` of that batch;
TP / SP / EP / CP and DP do not change it. Splitting the batch into more micro-batches (or
``forward_backward`` calls) changes which tokens are pooled, as it does in transformers.

``forward_only`` adds and reports it too, as transformers' forward does with
``output_router_logits`` on in eval mode (its loss is ``CE + coef * aux``); no gradient is
prepared or exchanged there.

Pipeline parallelism: a stage's backward needs the counts of the later stages' layers of the
same micro-batch. :class:`PipelineExchange` sends each stage's statistics, right after its
forward of a micro-batch, to the last stage of its pipeline, which pools them at the loss and
sends the gradient vector back; a stage receives it in its backward of that micro-batch (which
the 1F1B schedule runs after the last stage's loss). The messages go over a process group of
their own per pipeline, in micro-batch order. Interleaved (virtual) pipelines are not supported.
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

from ..layers.router import (Collector, PooledAuxGrad, RoutingStats,  # noqa: F401 (re-exported)
                            load_balancing_loss, router_class)


def coefficient(hf_config: dict, override: Optional[float] = None) -> float:
    """The aux-loss coefficient the model trains with: ``override`` when given, else the HF
    config's ``router_aux_loss_coef`` if its ``output_router_logits`` is on (transformers adds no
    aux loss otherwise), else 0. Composite (vision + text) configs are read from ``text_config``."""
    if override is not None:
        if isinstance(override, bool) or not isinstance(override, (int, float)) or override < 0:
            raise ValueError(f"router_aux_loss_coef must be a number >= 0, got {override!r}")
        return float(override)
    cfg = hf_config.get("text_config") or hf_config
    if not cfg.get("output_router_logits", False):
        return 0.0
    return float(cfg.get("router_aux_loss_coef", 0.0) or 0.0)


def attach(chunks, collector: Optional[Collector]) -> int:
    """Point every router of ``chunks`` built by :func:`router_class` at ``collector``; returns
    how many there are."""
    cls = router_class()
    n = 0
    for chunk in chunks:
        for m in chunk.modules():
            if isinstance(m, cls):
                m.aux_collector = collector
                n += 1
    return n


def build(hf_config: dict, shape, mesh, chunks, override: Optional[float] = None):
    """The model's ``(Collector | None, PipelineExchange | None)``, with its routers attached:
    the coefficient from :func:`coefficient`; 0 turns the aux loss off."""
    coef = coefficient(hf_config, override)
    if coef and not shape.num_experts:
        raise ValueError(f"router_aux_loss_coef={coef}: {shape.model_type} has no MoE layers")
    if coef and mesh.vpp_size > 1:
        raise NotImplementedError("the MoE aux loss with an interleaved (virtual) pipeline is not "
                                  "supported (pass router_aux_loss_coef=0 to train without it)")
    collector = Collector(coef, shape.num_experts, shape.moe_topk) if coef else None
    if shape.num_experts:
        attach(chunks, collector)
    return collector, PipelineExchange() if coef and mesh.pp_size > 1 else None


def router_padding(padding: torch.Tensor, chunk, mesh) -> torch.Tensor:
    """megatron's ``padding_mask`` [rows, S] for ``chunk``: GPTModel cuts it to this rank's
    sequence-parallel share only on the first pipeline stage, so later stages get the cut one."""
    if chunk.pre_process or not mesh.sequence_parallel:
        return padding
    from megatron.core import parallel_state as ps
    n = padding.shape[1] // mesh.tp_size
    r = ps.get_tensor_model_parallel_rank()
    return padding[:, r * n:(r + 1) * n]


class PipelineExchange:
    """Point-to-point exchange of each micro-batch's :class:`RoutingStats` between the stages of
    this rank's pipeline (see the module docstring). Collective to build: every rank builds one."""

    def __init__(self):
        from megatron.core import parallel_state as ps
        mine = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
        every: List = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        self.group = None
        for ranks in sorted({tuple(r) for r in every}):   # the same order on every rank
            group = dist.new_group(list(ranks))
            if list(ranks) == list(mine):
                self.group = group
        self.ranks, self.last, self.me = list(mine), mine[-1], dist.get_rank()
        self._pending = []   # (work, tensor) of sends not waited for yet

    def send_stats(self, stats: RoutingStats) -> None:
        """A stage before the last, after its forward of a micro-batch."""
        vec = stats.vector()
        self._pending.append((dist.isend(vec, dst=self.last, group=self.group), vec))

        def fetch():
            grad = torch.empty(stats.num_experts, dtype=torch.float32, device=vec.device)
            dist.recv(grad, src=self.last, group=self.group)
            stats.grad = grad
        stats.fetch_grad = fetch

    def gather_stats(self, stats: RoutingStats) -> None:
        """The last stage, at the micro-batch's loss: add the earlier stages' statistics."""
        for src in self.ranks[:-1]:
            vec = torch.empty(2 * stats.num_experts + 1, dtype=torch.float64, device=stats.counts.device)
            dist.recv(vec, src=src, group=self.group)
            stats.add_vector(vec)

    def send_grad(self, stats: RoutingStats) -> None:
        """The last stage, once the micro-batch's aux loss is finished."""
        grad = stats.grad.float().contiguous()
        for dst in self.ranks[:-1]:
            self._pending.append((dist.isend(grad, dst=dst, group=self.group), grad))

    def wait(self) -> None:
        """After the schedule: every send was received (the receivers ran their backward)."""
        for work, _ in self._pending:
            work.wait()
        self._pending = []


def with_aux_loss(loss_func, stats: RoutingStats, coef: float, *, sequence_parallel: bool,
                  exchange: Optional[PipelineExchange] = None, backward: bool = True):
    """A megatron loss_func (the schedule's, :func:`twinkle_megatron.training.schedule.run`) that also
    finishes this micro-batch's aux loss: its report's stats gain ``coef * W * aux`` in the loss
    sum and ``[W * aux, W]`` (the ``aux_loss`` metric) on the first data/context-parallel rank.
    ``backward=False`` (``forward_only``): the earlier pipeline stages wait for no gradient, so
    none is sent."""
    from megatron.core import parallel_state as ps

    def loss_func_with_aux(output):
        loss_sum, count, report = loss_func(output)
        if exchange is not None:
            exchange.gather_stats(stats)
        tp_first = ps.get_tensor_model_parallel_rank() == 0
        w, value = stats.finish(count, coef=coef,
                                group=ps.get_tensor_and_data_parallel_group(with_context_parallel=True),
                                contributes_tokens=sequence_parallel or tp_first, contributes_weight=tp_first)
        if exchange is not None and backward:
            exchange.send_grad(stats)
        s = report["stats"].clone()
        extra = torch.stack([w * value, w]).to(s.dtype)
        if ps.get_data_parallel_rank(with_context_parallel=True) == 0:
            s[0] += coef * extra[0]
        else:
            extra = torch.zeros_like(extra)
        report = dict(report, stats=torch.cat([s, extra]))
        return loss_sum, count, report

    return loss_func_with_aux
