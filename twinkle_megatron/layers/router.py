"""megatron's ``TopKRouter`` that also collects the routing statistics of transformers' pooled
MoE load-balancing loss (see :mod:`twinkle_megatron.training.aux_loss` for the formula and how
the facade uses them): :class:`RoutingStats` (additive per-micro-batch statistics, pooled over ranks by
``finish``), :class:`PooledAuxGrad` (hands each router its gradient in the backward),
:class:`Collector` (which micro-batch the routers add to) and :func:`router_class` (chosen in
the layer spec; routing itself is megatron's, unchanged).

Router replay (``forward_only(return_routed_experts=True)``, ``routed_experts=``; the plumbing is
:mod:`twinkle_megatron.training.router_replay`) runs on megatron's engine,
``megatron.core.transformer.moe.router_replay.RouterReplay``: ``TopKRouter.routing`` hands its
instance to ``topk_routing_with_score_function``, whose top-k step records the ids (action
RECORD), or takes given ids and gathers the current router's scores there (REPLAY_FORWARD, and
REPLAY_BACKWARD for the rerun of an activation-recomputed layer, which pops the ids of the
micro-batches in forward order). Gate weights then follow the family's own formula at those ids
(softmax of the k logits, i.e. renormalised; softmax over all experts gathered, not renormalised;
sigmoid gathered without the expert bias, renormalised, scaled). Each :func:`router_class` router
holds its own instance whatever ``moe_enable_routing_replay`` says: that flag only makes megatron
build one and append it to ``RouterReplay.global_router_replay_instances``, a list of every
router of the process whose static methods drive all of them at once (two models in one process,
a teacher and a student, would share it), so the facade takes its instance off that list and
drives the instances of one model's routers itself."""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.distributed as dist


def load_balancing_loss(counts: torch.Tensor, prob_sums: torch.Tensor, rows) -> torch.Tensor:
    """``E * sum_e (counts_e / rows) * (prob_sums_e / rows)``: transformers' pooled aux loss from
    its additive statistics (counts [E], prob_sums [E], rows = counted tokens times layers)."""
    e = counts.shape[-1]
    if not float(rows):
        return counts.new_zeros([])
    return e * (counts * prob_sums).sum() / (rows * rows)


class RoutingStats:
    """The routing statistics of one micro-batch, summed over its MoE layers (float64)."""

    def __init__(self, num_experts: int, device):
        self.num_experts = num_experts
        self.counts = torch.zeros(num_experts, dtype=torch.float64, device=device)
        self.prob_sums = torch.zeros(num_experts, dtype=torch.float64, device=device)
        self.rows = torch.zeros([], dtype=torch.float64, device=device)
        self.value = None      # the pooled aux loss (float64), once finished
        self.grad = None       # d(weighted aux) / d(local summed probs) [E], once finished
        # pipeline stages before the last: fetches ``grad`` from the last stage (set by the facade)
        self.fetch_grad = None

    def add(self, logits: torch.Tensor, topk: int, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One layer's routing: ``logits`` [T, E] (any float dtype), ``valid`` [T] bool (None: all
        tokens count). Returns this layer's summed probabilities [E] fp32, differentiable, for
        :class:`PooledAuxGrad`."""
        probs = torch.softmax(logits.float(), dim=-1)
        top = torch.topk(probs.detach(), topk, dim=-1).indices
        w = None if valid is None else valid.to(probs.dtype)
        routed = torch.zeros_like(probs.detach()).scatter_(1, top, 1.0)
        if w is not None:
            routed = routed * w[:, None]
            probs = probs * w[:, None]
        prob_sum = probs.sum(0)
        self.counts += routed.sum(0).double()
        self.prob_sums += prob_sum.detach().double()
        self.rows += float(logits.shape[0]) if w is None else w.sum().double()
        return prob_sum

    def vector(self) -> torch.Tensor:
        """[counts, prob_sums, rows] (float64 [2E + 1]), what a pipeline stage sends on."""
        return torch.cat([self.counts, self.prob_sums, self.rows.reshape(1)])

    def add_vector(self, vec: torch.Tensor) -> None:
        """Add another pipeline stage's :meth:`vector` of the same micro-batch."""
        e = self.num_experts
        self.counts += vec[:e]
        self.prob_sums += vec[e:2 * e]
        self.rows += vec[2 * e]

    def finish(self, weight, *, coef: float, group=None, contributes_tokens: bool = True,
               contributes_weight: bool = True) -> torch.Tensor:
        """Pool the statistics (and ``weight``, this rank's loss count) over ``group`` and fix
        the gradient ``coef * W * E * C / R**2`` (W the pooled weight). A rank that holds a copy
        of tokens another rank counts (tensor parallel without SP) passes
        ``contributes_tokens=False``; one whose count another rank already reports,
        ``contributes_weight=False``. Returns the pooled ``[weight, aux]`` (float64)."""
        w = torch.as_tensor(weight, dtype=torch.float64, device=self.counts.device).reshape(1)
        keep = 1.0 if contributes_tokens else 0.0
        vec = torch.cat([self.counts * keep, self.prob_sums * keep, (self.rows * keep).reshape(1),
                         w * (1.0 if contributes_weight else 0.0)])
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(vec, group=group)
        e = self.num_experts
        counts, prob_sums, rows, w = vec[:e], vec[e:2 * e], vec[2 * e], vec[2 * e + 1]
        self.value = load_balancing_loss(counts, prob_sums, rows)
        scale = coef * w * e / (rows * rows) if float(rows) else 0.0 * w
        self.grad = (scale * counts).float()
        return torch.stack([w, self.value])


class PooledAuxGrad(torch.autograd.Function):
    """``probs`` unchanged; in the backward, ``prob_sum`` (one layer's summed router
    probabilities [E]) gets ``stats.grad`` times the main loss's backward scale."""

    @staticmethod
    def forward(ctx, probs, prob_sum, stats):
        ctx.stats = stats
        return probs

    @staticmethod
    def backward(ctx, grad_probs):
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
        if ctx.stats.grad is None and ctx.stats.fetch_grad is not None:
            ctx.stats.fetch_grad()
        grad = ctx.stats.grad
        if grad is None:
            raise RuntimeError("the aux loss of this micro-batch was never finished (its loss "
                               "function did not run before the backward)")
        scale = MoEAuxLossAutoScaler.main_loss_backward_scale
        if scale is not None:
            grad = grad * scale.to(grad.dtype).reshape([])
        return grad_probs, grad.to(grad_probs.device), None


class Collector:
    """Per model: which micro-batch's :class:`RoutingStats` the routers add to (None: none)."""

    def __init__(self, coef: float, num_experts: int, topk: int):
        self.coef = float(coef)
        self.num_experts = num_experts
        self.topk = topk
        self.current: Optional[RoutingStats] = None

    def begin(self, device) -> RoutingStats:
        self.current = RoutingStats(self.num_experts, device)
        return self.current

    def end(self) -> Optional[RoutingStats]:
        stats, self.current = self.current, None
        return stats


def routed_ids(replay, probs: torch.Tensor) -> Optional[torch.Tensor]:
    """The expert ids [tokens, k] (int64) ``replay`` (a megatron ``RouterReplay``) routed with in
    the forward that gave ``probs`` [tokens, E] (the routing weights, 0 off the chosen experts):
    the recorded ids (RECORD), sorted by descending weight (0.19 leaves top-k unsorted without
    grad; the order does not change the routing), or the replayed ones (REPLAY_FORWARD); None
    under any other action."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction
    action = replay.router_replay_action
    if action == RouterReplayAction.RECORD:
        ids = replay.recorded_topk_idx
        order = torch.sort(probs.detach().float().gather(1, ids), dim=1, descending=True, stable=True).indices
        return ids.gather(1, order).long()
    if action == RouterReplayAction.REPLAY_FORWARD:
        return replay.target_topk_idx.long()
    return None


@functools.lru_cache(maxsize=None)
def router_class() -> type:
    from megatron.core.transformer.moe.router import TopKRouter

    class TwinkleRouter(TopKRouter):
        """megatron's TopKRouter that adds its routing to the collector's current
        :class:`RoutingStats` (see the module docstring); routing itself is unchanged."""
        aux_collector: Optional[Collector] = None

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            from megatron.core.transformer.moe.router_replay import RouterReplay
            if self.router_replay is None:
                self.router_replay = RouterReplay()
            # this model's routers are driven one by one (module docstring), not through the
            # process-wide list
            if self.router_replay in RouterReplay.global_router_replay_instances:
                RouterReplay.global_router_replay_instances.remove(self.router_replay)
            self.routed = None   # [tokens, k] int64: the ids of the last forward, when recording

        def routing(self, logits, padding_mask=None):
            probs, routing_map = super().routing(logits, padding_mask)
            self.routed = routed_ids(self.router_replay, probs)
            c = self.aux_collector
            if c is not None and c.current is not None:
                flat = logits.reshape(-1, self.config.num_moe_experts)
                # megatron's padding_mask is True at padding ([S, B] here, like the logits)
                valid = None if padding_mask is None else ~padding_mask.reshape(-1)
                prob_sum = c.current.add(flat, self.topk, valid)
                if torch.is_grad_enabled():   # forward_only collects the value, no gradient
                    probs = PooledAuxGrad.apply(probs, prob_sum, c.current)
            return probs, routing_map

    return TwinkleRouter
