"""Pluggable training losses for :class:`~twinkle_megatron.MegatronModel`: cross entropy (the
default), the GRPO family (``grpo``, ``dr_grpo``, ``bnpo``, ``gspo``, ``cispo``, ``sapo``), the
preference losses (``dpo``, ``simpo``, ``cpo``, ``orpo``) and ``gkd`` (distillation from a
teacher's top-k log-probs or full-vocabulary logits).

The interface: a loss is a callable taking :class:`LossInputs` (the per-token tensors of one
micro-batch, in the user's row layout) and returning ``(loss_sum, count)`` — optionally
``(loss_sum, count, metrics)`` with ``metrics = {name: (sum, count)}``. ``count`` is an integer:
the facade sums ``loss_sum``'s gradients and ``count`` over micro-batches, ``forward_backward``
calls and data-parallel ranks, and divides once (megatron's per-token-loss finalisation), so the
optimised objective is ``sum(loss_sum) / sum(count)`` over the global batch however it is split.
Every aggregation is therefore written as a sum over the micro-batch's sequences or tokens:

- token mean (cross entropy, BNPO, CISPO):  sum_tokens l / number of tokens;
- sequence mean (GRPO, GSPO):              sum_seq (mean_{t in seq} l) / number of sequences;
- fixed length (Dr. GRPO):                 sum_tokens l / (number of sequences * max_length).

A sequence is a row, or one packed sample inside a row (``position_ids`` restarting at 0); only
sequences with at least one loss token count. Sequences never straddle micro-batches (under
context parallelism the facade reassembles each row before the loss), so segment-level terms
(GSPO's sequence ratio, DPO's sums) are exact.

Notation: ``logp`` the current log-prob of the label token, ``old`` / ``ref`` the sampler's and
reference model's (``old_logps`` / ``ref_logps``; ``old`` defaults to ``logp`` detached, i.e.
on-policy), ``A`` the advantage, ``r = exp(logp - old)``, ``sg`` stop-gradient, ``H`` the token
entropy, and ``k3 = exp(ref - logp) - (ref - logp) - 1`` (the k3 estimator of KL(pi || ref)).

Top-k arguments. A loss may take per-token arguments with a trailing dimension, ``[B, S, k]``
(listed in its ``topk_arguments``; laid out and shifted along S exactly like the [B, S] ones), and
name one of them, an integer tensor of vocabulary ids, in ``student_topk``: the loss step then
evaluates the student's LM head at those k ids per token only (no ``[tokens, V]`` logits on the
fused LM-head path; gathered from the vocab-parallel logits otherwise; summed over the TP group)
and hands them over as ``LossInputs.student_topk_logits`` [N, S, k] fp32, the raw logits (not
divided by ``forward_backward``'s ``temperature``).

Full-vocabulary teacher. ``teacher_logits`` [B, S, V] (GKD) is not handed to the loss as a
tensor: the loss step gives ``LossInputs.teacher_divergence``, a function of (beta, temperature)
returning the generalized JSD per token, computed from the student's final hidden states and LM
head chunk by chunk (no [tokens, V] student logits on the fused path; from the vocab-parallel
logits otherwise), vocab-parallel under TP.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

Tensor = torch.Tensor

# Arguments the facade knows how to slice per micro-batch; a loss lists those it takes in
# ``accepts`` (a user loss may add its own names: they arrive in LossInputs.extras).
PER_TOKEN_ARGUMENTS = ("advantages", "old_logps", "ref_logps")
# The teacher's top-k of GKD, [B, S, k] each (see GKDLoss)
TEACHER_TOPK = ("teacher_topk_logps", "teacher_topk_indices")
# GKD's full-vocabulary teacher, [B, S, V] as a model returns logits (position t predicts t + 1)
TEACHER_LOGITS = "teacher_logits"


@dataclasses.dataclass
class LossInputs:
    """One micro-batch, rows in the order the user passed them (packed rows as packed).

    logps: [N, S] fp32 (differentiable) log-prob of each position's label; entropy: [N, S] fp32
    or None (only when the loss sets ``needs_entropy`` or the caller asked for it); loss_mask:
    [N, S] bool, the positions whose label is not ``ignore_index``; segment_ids: [N, S] int64,
    the sequence (0 .. num_segments - 1, in order) each position belongs to; advantages /
    old_logps / ref_logps: [N, S] fp32 aligned with ``logps`` or None; extras: other per-sample
    arguments, [N] or [N, S] (or [N, S, k] for a loss's ``topk_arguments``); student_topk_logits:
    [N, S, k] fp32 (differentiable) raw logits of the student at the vocabulary ids of the loss's
    ``student_topk`` argument (position t: the logits predicting token t, as ``logps``), or None;
    teacher_divergence: with a ``teacher_logits`` argument, ``f(beta, temperature)`` -> [N, S] fp32
    (differentiable), the generalized JSD (:class:`GKDLoss`) of each position between the
    student's and the teacher's full-vocabulary distributions at that temperature (0 where
    ``loss_mask`` is False), or None; argmax_correct: [N, S] bool, whether each position's label is
    the argmax of the model's distribution there (False off ``loss_mask``), or None (computed when
    a metric sets ``needs_argmax``, e.g. :class:`~twinkle_megatron.training.metrics.Accuracy`).
    """
    logps: Tensor
    loss_mask: Tensor
    segment_ids: Tensor
    num_segments: int
    entropy: Optional[Tensor] = None
    advantages: Optional[Tensor] = None
    old_logps: Optional[Tensor] = None
    ref_logps: Optional[Tensor] = None
    extras: Dict[str, Tensor] = dataclasses.field(default_factory=dict)
    row_length: Optional[int] = None
    student_topk_logits: Optional[Tensor] = None
    teacher_divergence: Optional[Callable[[float, float], Tensor]] = None
    argmax_correct: Optional[Tensor] = None

    def segment_sum(self, values: Tensor) -> Tensor:
        """Sum of ``values`` [N, S] over each sequence's loss tokens -> [num_segments]."""
        out = values.new_zeros(self.num_segments)
        masked = torch.where(self.loss_mask, values, torch.zeros_like(values))
        return out.index_add(0, self.segment_ids.reshape(-1), masked.reshape(-1))

    def segment_tokens(self) -> Tensor:
        """Loss tokens per sequence -> [num_segments] fp32."""
        return self.segment_sum(torch.ones_like(self.logps, dtype=torch.float32).detach())


class Loss:
    """Base class of the facade's losses (a user loss may also be any callable with the same
    contract and, optionally, these attributes).

    accepts: per-sample argument names ``forward_backward`` may pass; required: those it must;
    needs_entropy: whether LossInputs.entropy must be computed; metric_names: the keys of the
    metrics dict it returns (fixed, so every rank reduces the same list); ignore_index: the label
    value that marks positions without a loss; topk_arguments: those of ``accepts`` shaped
    [B, S, k] (else [B] / [B, S]); student_topk: the name of the [B, S, k] integer argument (one of
    ``topk_arguments``) at whose vocabulary ids the student's logits are computed for
    ``LossInputs.student_topk_logits`` (None: not computed); unsupported: ``{argument: why}``,
    arguments refused with NotImplementedError; max_metric_names (optional): those of
    ``metric_names`` whose ``sum`` is a maximum (of values >= 0), kept as the maximum over
    micro-batches, calls and ranks. Two optional hooks: ``missing_arguments(kwargs)``
    (the names of ``required`` absent from ``kwargs``, for a loss whose requirement depends on what
    was given; may raise ValueError for a bad combination) and ``prepare_argument(name, value,
    labels, loss_mask, vocab_size)`` (an argument in the user's layout -> its tensor, or None for
    the default handling). logps_grad_uniform: the loss's gradient of ``LossInputs.logps`` is one
    number at every ``loss_mask`` position and 0 elsewhere (a token-sum NLL): the fused LM head
    then computes its gradients in the forward, three GEMMs instead of four (it checks that in
    the backward and recomputes otherwise, so a wrong True costs time, never correctness).
    """
    accepts: Tuple[str, ...] = ()
    required: Tuple[str, ...] = ()
    needs_entropy: bool = False
    metric_names: Tuple[str, ...] = ()
    ignore_index: int = -100
    topk_arguments: Tuple[str, ...] = ()
    student_topk: Optional[str] = None
    unsupported: Dict[str, str] = {}
    logps_grad_uniform: bool = False

    def __call__(self, inputs: LossInputs):
        raise NotImplementedError


class CrossEntropyLoss(Loss):
    """Token-mean negative log-likelihood: ``sum_t -logp_t / tokens`` (over the global batch)."""
    name = "cross_entropy"
    logps_grad_uniform = True

    def __init__(self, ignore_index: int = -100):
        self.ignore_index = ignore_index

    def __call__(self, x: LossInputs):
        return -(x.logps * x.loss_mask).sum(), x.loss_mask.sum()


class GRPOLoss(Loss):
    """GRPO (clipped policy gradient, per-sequence mean then mean over sequences)::

        l_t = -min(r_t * A_t, clip(r_t, 1 - epsilon, 1 + epsilon_high) * A_t)
              + beta * k3_t - entropy_coef * H_t
        loss = sum_seq (sum_{t in seq} l_t / |seq|) / number of sequences

    ``epsilon_high`` defaults to ``epsilon``; ``beta > 0`` needs ``ref_logps``; ``entropy_coef``
    makes the facade compute entropies. Metrics: clip_frac (tokens whose ratio was clipped in the
    direction that matters for the sign of A), kl (k3, when ref_logps are given), entropy (when
    computed, as mean_entropy: ``entropy`` is the per-token output), all token means.
    """
    name = "grpo"
    accepts = PER_TOKEN_ARGUMENTS
    required = ("advantages",)
    metric_names = ("clip_frac", "kl", "mean_entropy")

    def __init__(self, epsilon: float = 0.2, epsilon_high: Optional[float] = None, beta: float = 0.0,
                 entropy_coef: float = 0.0, ignore_index: int = -100):
        if not epsilon >= 0:
            raise ValueError(f"epsilon must be >= 0, got {epsilon!r}")
        if epsilon_high is not None and not epsilon_high >= 0:
            raise ValueError(f"epsilon_high must be >= 0, got {epsilon_high!r}")
        self.epsilon = float(epsilon)
        self.epsilon_high = float(epsilon if epsilon_high is None else epsilon_high)
        self.beta = float(beta)
        self.entropy_coef = float(entropy_coef)
        self.ignore_index = ignore_index
        self.needs_entropy = self.entropy_coef != 0.0
        if self.beta:
            self.required = self.required + ("ref_logps",)

    def log_ratio(self, x: LossInputs) -> Tensor:
        old = x.logps.detach() if x.old_logps is None else x.old_logps
        return x.logps - old

    def per_token(self, x: LossInputs):
        """-> (per-token loss [N, S], clipped [N, S] bool)."""
        ratio = self.log_ratio(x).exp()
        adv = x.advantages
        clipped_ratio = ratio.clamp(1.0 - self.epsilon, 1.0 + self.epsilon_high)
        loss = -torch.minimum(ratio * adv, clipped_ratio * adv)
        clipped = ((ratio < 1.0 - self.epsilon) & (adv < 0)) | ((ratio > 1.0 + self.epsilon_high) & (adv > 0))
        if self.beta:
            loss = loss + self.beta * k3(x.logps, x.ref_logps)
        if self.entropy_coef:
            loss = loss - self.entropy_coef * x.entropy
        return loss, clipped

    def aggregate(self, loss: Tensor, x: LossInputs):
        tokens = x.segment_tokens()
        seq_mean = x.segment_sum(loss) / tokens.clamp(min=1)
        return seq_mean.sum(), (tokens > 0).sum()

    def __call__(self, x: LossInputs):
        loss, clipped = self.per_token(x)
        total, count = self.aggregate(loss, x)
        return total, count, policy_metrics(x, clipped)


class DrGRPOLoss(GRPOLoss):
    """Dr. GRPO: the GRPO token loss summed and divided by a fixed length, not by each sequence's::

        loss = sum_tokens l_t / (number of sequences * max_length)

    ``max_length``: the fixed generation budget, 1024 by default as upstream Twinkle's
    ``max_completion_length`` (accepted as its spelling); a fixed number, not the batch's row
    length, so that the loss's scale (hence clipping and weight decay's share) does not move with
    how long a batch happens to be padded.
    """
    name = "dr_grpo"

    def __init__(self, epsilon: float = 0.2, epsilon_high: Optional[float] = None, beta: float = 0.0,
                 entropy_coef: float = 0.0, ignore_index: int = -100, max_length: Optional[int] = None,
                 max_completion_length: Optional[int] = None):
        super().__init__(epsilon, epsilon_high, beta, entropy_coef, ignore_index)
        if max_completion_length is not None:
            if max_length is not None:
                raise TypeError("DrGRPOLoss: give max_length or upstream's spelling max_completion_length, not both")
            max_length = max_completion_length
        max_length = 1024 if max_length is None else max_length
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
            raise ValueError(f"max_length must be a positive int, got {max_length!r}")
        self.max_length = max_length

    def aggregate(self, loss, x):
        length = self.max_length
        sequences = (x.segment_tokens() > 0).sum()
        return (loss * x.loss_mask).sum() / length, sequences


class BNPOLoss(GRPOLoss):
    """BNPO: the GRPO token loss averaged over every loss token of the global batch::

        loss = sum_tokens l_t / number of tokens
    """
    name = "bnpo"

    def aggregate(self, loss, x):
        return (loss * x.loss_mask).sum(), x.loss_mask.sum()


class GSPOLoss(GRPOLoss):
    """GSPO: GRPO with the sequence-level importance ratio (the token form, GSPO-token)::

        s_i = exp(mean_{t in seq i} (logp_t - old_t))
        r_t = sg(s_i) * exp(logp_t - sg(logp_t))          (value s_i, gradient s_i * d logp_t)
        l_t and the aggregation as in GRPO (per-sequence mean, then mean over sequences)

    With one advantage per sequence this is the GSPO objective
    ``-mean_i min(s_i A_i, clip(s_i, 1 - epsilon, 1 + epsilon_high) A_i)``; the defaults
    ``epsilon=3e-4, epsilon_high=4e-4`` are the paper's.
    """
    name = "gspo"

    def __init__(self, epsilon: float = 3e-4, epsilon_high: Optional[float] = 4e-4, beta: float = 0.0,
                 entropy_coef: float = 0.0, ignore_index: int = -100):
        super().__init__(epsilon, epsilon_high, beta, entropy_coef, ignore_index)

    def log_ratio(self, x):
        token = super().log_ratio(x)
        seq = x.segment_sum(token.detach()) / x.segment_tokens().clamp(min=1)
        return seq[x.segment_ids] + x.logps - x.logps.detach()


class CISPOLoss(GRPOLoss):
    """CISPO (MiniMax-M1): a clipped, stop-gradient importance weight on the REINFORCE term, token
    mean over the global batch::

        w_t = sg(clip(r_t, 1 - epsilon, 1 + epsilon_high))
        l_t = -w_t * A_t * logp_t + beta * k3_t - entropy_coef * H_t
        loss = sum_tokens l_t / number of tokens

    Defaults: no lower clip (``epsilon=1.0``), ``epsilon_high=4.0`` (weights capped at 5).
    """
    name = "cispo"

    def __init__(self, epsilon: float = 1.0, epsilon_high: Optional[float] = 4.0, beta: float = 0.0,
                 entropy_coef: float = 0.0, ignore_index: int = -100):
        super().__init__(epsilon, epsilon_high, beta, entropy_coef, ignore_index)

    def per_token(self, x):
        ratio = self.log_ratio(x).detach().exp()
        weight = ratio.clamp(1.0 - self.epsilon, 1.0 + self.epsilon_high)
        loss = -weight * x.advantages * x.logps
        clipped = (ratio > 1.0 + self.epsilon_high) | (ratio < 1.0 - self.epsilon)
        if self.beta:
            loss = loss + self.beta * k3(x.logps, x.ref_logps)
        if self.entropy_coef:
            loss = loss - self.entropy_coef * x.entropy
        return loss, clipped

    def aggregate(self, loss, x):
        return (loss * x.loss_mask).sum(), x.loss_mask.sum()


class DPOLoss(Loss):
    """DPO on chosen / rejected pairs: consecutive sequences 2k (chosen) and 2k + 1 (rejected) of
    each micro-batch (rows, or packed samples), with ``ref_logps``::

        pi_i = sum_{t in seq i} logp_t,   ref_i = sum_{t in seq i} ref_t   (0 with reference_free)
        c_k = pi_2k - ref_2k,  r_k = pi_2k+1 - ref_2k+1,  z_k = beta * (c_k - r_k)
        loss = sum_k l_k / number of pairs

    with ``l_k`` by ``loss_type`` (upstream Twinkle's list and formulas):

    - ``"sigmoid"`` (DPO): ``-(1 - label_smoothing) log sigmoid(z) - label_smoothing log sigmoid(-z)``;
    - ``"hinge"`` (SLiC): ``relu(1 - z)``;
    - ``"ipo"``: ``(z - 1 / (2 beta))^2`` (on summed log-probs, as upstream; TRL's IPO averages them
      over the tokens);
    - ``"kto_pair"``: ``1 - sigmoid(beta c) + sigmoid(beta r)``.

    ``label_smoothing`` applies to ``"sigmoid"`` only (a ValueError otherwise, as upstream).
    ``reference_free=True``: no reference model (``ref_logps`` not needed, and ignored if given).
    ``sft_weight`` = w > 0 adds upstream's NLL on the chosen sequences (:func:`chosen_nll`)::

        loss = sum_k (l_k + w * nll_k) / number of pairs,   nll_k = -sum_{t in seq 2k} logp_t / tokens_2k

    Upstream takes the NLL's token mean over each micro-batch's chosen rows and averages the
    micro-batches; with its default of one pair per micro-batch (``micro_batch_size=2``) that is
    ``nll_k``. Here it is per pair whatever the split (upstream with several pairs per
    micro-batch pools their tokens).

    Metrics: reward_acc (fraction of pairs with z > 0), margin (mean z / beta), and with
    ``sft_weight`` nll (the chosen tokens' mean NLL over the whole batch).
    """
    name = "dpo"
    accepts = ("ref_logps",)
    required = ("ref_logps",)
    metric_names = ("reward_acc", "margin")
    LOSS_TYPES = ("sigmoid", "hinge", "ipo", "kto_pair")

    def __init__(self, beta: float = 0.1, label_smoothing: float = 0.0, ignore_index: int = -100,
                 loss_type: str = "sigmoid", reference_free: bool = False, sft_weight: float = 0.0):
        if not beta > 0:
            raise ValueError(f"beta must be > 0 for dpo, got {beta!r}")
        if not 0.0 <= label_smoothing < 0.5:
            raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing!r}")
        if loss_type not in self.LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {list(self.LOSS_TYPES)}, got {loss_type!r}")
        if label_smoothing and loss_type != "sigmoid":
            raise ValueError(f"label_smoothing={label_smoothing} applies to loss_type='sigmoid' only, "
                             f"got loss_type={loss_type!r}")
        if not isinstance(reference_free, bool):
            raise TypeError(f"reference_free must be a bool, got {reference_free!r}")
        self.sft_weight = _weight("sft_weight", sft_weight)
        if self.sft_weight:
            self.metric_names = self.metric_names + ("nll",)
        self.beta = float(beta)
        self.label_smoothing = float(label_smoothing)
        self.loss_type = loss_type
        self.reference_free = reference_free
        self.ignore_index = ignore_index
        if reference_free:
            self.required = ()

    def __call__(self, x: LossInputs):
        keep = x.segment_tokens() > 0
        pi = x.segment_sum(x.logps)[keep]
        if len(pi) % 2:
            raise ValueError(f"dpo needs chosen/rejected pairs: a micro-batch has {len(pi)} sequences "
                             "(use an even micro_batch_size, pairs in consecutive rows)")
        d = pi if self.reference_free else pi - x.segment_sum(x.ref_logps)[keep]
        c, r = d[0::2], d[1::2]
        z = self.beta * (c - r)
        if self.loss_type == "sigmoid":
            ls = self.label_smoothing
            loss = -(1 - ls) * F.logsigmoid(z) - ls * F.logsigmoid(-z)
        elif self.loss_type == "hinge":
            loss = torch.relu(1 - z)
        elif self.loss_type == "ipo":
            loss = (z - 1 / (2 * self.beta)) ** 2
        else:   # kto_pair
            loss = 1 - torch.sigmoid(self.beta * c) + torch.sigmoid(self.beta * r)
        pairs = torch.tensor(len(z), device=z.device)
        zd = z.detach()
        metrics = {"reward_acc": ((zd > 0).float().sum(), pairs), "margin": (zd.sum() / self.beta, pairs)}
        total = loss.sum()
        if self.sft_weight:
            nll, tokens = chosen_nll(x, keep)
            total = total + self.sft_weight * (nll / tokens).sum()
            metrics["nll"] = (nll.detach().sum(), tokens.sum())
        return total, pairs, metrics


class SimPOLoss(Loss):
    """SimPO (reference-free) on chosen / rejected pairs, consecutive sequences as for :class:`DPOLoss`,
    with upstream Twinkle's (and the paper's) length-normalised reward::

        a_i = sum_{t in seq i} logp_t / tokens_i
        loss = sum_k -log sigmoid(beta (a_2k - a_2k+1) - gamma) / number of pairs

    Metrics: reward_acc (fraction of pairs with a_2k > a_2k+1), margin (mean a_2k - a_2k+1)."""
    name = "simpo"
    accepts = ()
    required = ()
    metric_names = ("reward_acc", "margin")

    def __init__(self, beta: float = 2.5, gamma: float = 0.5, ignore_index: int = -100):
        if not beta > 0:
            raise ValueError(f"beta must be > 0 for simpo, got {beta!r}")
        if not math.isfinite(gamma):
            raise ValueError(f"gamma must be finite, got {gamma!r}")
        self.beta, self.gamma, self.ignore_index = float(beta), float(gamma), ignore_index

    def __call__(self, x: LossInputs):
        n = x.segment_tokens()
        keep = n > 0
        avg = x.segment_sum(x.logps)[keep] / n[keep]
        if len(avg) % 2:
            raise ValueError(f"simpo needs chosen/rejected pairs: a micro-batch has {len(avg)} sequences "
                             "(use an even micro_batch_size, pairs in consecutive rows)")
        diff = avg[0::2] - avg[1::2]
        loss = -F.logsigmoid(self.beta * diff - self.gamma)
        pairs = torch.tensor(len(diff), device=diff.device)
        d = diff.detach()
        return loss.sum(), pairs, {"reward_acc": ((d > 0).float().sum(), pairs), "margin": (d.sum(), pairs)}


def _weight(name: str, value) -> float:
    """A loss coefficient: a finite real number >= 0, else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def preference_pairs(x: LossInputs, name: str) -> Tensor:
    """[num_segments] bool: the sequences with loss tokens, which must pair up (2k chosen,
    2k + 1 rejected); an odd number is a ValueError naming the loss ``name``."""
    keep = x.segment_tokens() > 0
    n = int(keep.sum())
    if n % 2:
        raise ValueError(f"{name} needs chosen/rejected pairs: a micro-batch has {n} sequences "
                         "(use an even micro_batch_size, pairs in consecutive rows)")
    return keep


def chosen_nll(x: LossInputs, keep: Tensor) -> Tuple[Tensor, Tensor]:
    """The NLL of a micro-batch's chosen sequences (every other one of those marked by ``keep``
    [num_segments] bool, from the first) -> ``(-sum of each one's token logps, its tokens)``,
    [pairs] each, the first differentiable."""
    return -x.segment_sum(x.logps)[keep][0::2], x.segment_tokens()[keep][0::2]


def log1mexp(a: Tensor) -> Tensor:
    """``log(1 - exp(a))`` for ``a`` <= 0, accurate at both ends (expm1 near 0, log1p far below);
    ``a`` is first capped at -1e-7 (upstream Twinkle's ORPO), so ``a`` = 0 (probability 1) stays
    finite."""
    a = a.clamp(max=-1e-7)
    return torch.where(a > -math.log(2.0), torch.log(-torch.expm1(a)), torch.log1p(-torch.exp(a)))


class CPOLoss(Loss):
    """CPO (Contrastive Preference Optimization), upstream Twinkle's: a reference-free DPO term plus
    behaviour cloning (NLL) on the chosen sequences, pairs as for :class:`DPOLoss`::

        pi_i = sum_{t in seq i} logp_t,   z_k = beta * (pi_2k - pi_2k+1)
        nll_k = -sum_{t in seq 2k} logp_t / tokens_2k           (:func:`chosen_nll`)
        loss = sum_k (-log sigmoid(z_k) + bc_coef * nll_k) / number of pairs

    ``nll_k`` as in :class:`DPOLoss` with ``sft_weight`` (upstream's with one pair per
    micro-batch, its default). Metrics: reward_acc (fraction of pairs with z > 0), margin (mean
    pi_2k - pi_2k+1), nll (the chosen tokens' mean NLL over the batch)."""
    name = "cpo"
    metric_names = ("reward_acc", "margin", "nll")

    def __init__(self, beta: float = 0.1, bc_coef: float = 1.0, ignore_index: int = -100):
        if _weight("beta", beta) == 0:
            raise ValueError(f"beta must be > 0 for cpo, got {beta!r}")
        self.beta, self.bc_coef, self.ignore_index = float(beta), _weight("bc_coef", bc_coef), ignore_index

    def __call__(self, x: LossInputs):
        keep = preference_pairs(x, self.name)
        pi = x.segment_sum(x.logps)[keep]
        diff = pi[0::2] - pi[1::2]
        nll, tokens = chosen_nll(x, keep)
        pairs = torch.tensor(len(diff), device=diff.device)
        total = (-F.logsigmoid(self.beta * diff) + self.bc_coef * nll / tokens).sum()
        d = diff.detach()
        return total, pairs, {"reward_acc": ((d > 0).float().sum(), pairs), "margin": (d.sum(), pairs),
                              "nll": (nll.detach().sum(), tokens.sum())}


class ORPOLoss(Loss):
    """ORPO (odds-ratio preference optimization, no reference model), upstream Twinkle's: the NLL of
    the chosen sequences plus ``lambda_orpo`` times the odds-ratio term, pairs as for
    :class:`DPOLoss`::

        a_i = sum_{t in seq i} logp_t / tokens_i            (length-normalised log-prob)
        lo_i = a_i - log(1 - exp(a_i))                     (log odds, :func:`log1mexp`)
        loss = sum_k (nll_k - lambda_orpo * log sigmoid(lo_2k - lo_2k+1)) / number of pairs

    ``nll_k`` as in :class:`CPOLoss`. Metrics: reward_acc (fraction of pairs with lo_2k > lo_2k+1),
    margin (mean lo_2k - lo_2k+1), nll."""
    name = "orpo"
    metric_names = ("reward_acc", "margin", "nll")

    def __init__(self, lambda_orpo: float = 0.1, ignore_index: int = -100):
        self.lambda_orpo, self.ignore_index = _weight("lambda_orpo", lambda_orpo), ignore_index

    def __call__(self, x: LossInputs):
        keep = preference_pairs(x, self.name)
        n = x.segment_tokens()[keep]
        avg = x.segment_sum(x.logps)[keep] / n
        log_odds = avg - log1mexp(avg)
        ratio = log_odds[0::2] - log_odds[1::2]
        nll, tokens = chosen_nll(x, keep)
        pairs = torch.tensor(len(ratio), device=ratio.device)
        total = (nll / tokens - self.lambda_orpo * F.logsigmoid(ratio)).sum()
        r = ratio.detach()
        return total, pairs, {"reward_acc": ((r > 0).float().sum(), pairs), "margin": (r.sum(), pairs),
                              "nll": (nll.detach().sum(), tokens.sum())}


class SAPOLoss(GRPOLoss):
    """SAPO (soft-gated policy optimization), upstream Twinkle's: GRPO with the clipped surrogate
    replaced by a smooth gate of the ratio, its temperature by the sign of the advantage::

        tau_t = tau_pos if A_t > 0 else tau_neg
        l_t = -sigmoid(tau_t * (r_t - 1)) * (4 / tau_t) * A_t + beta * k3_t - entropy_coef * H_t
        loss = sum_seq (sum_{t in seq} l_t / |seq|) / number of sequences   (as GRPO)

    At r = 1 the gate's slope is 1 (the policy gradient); away from 1 it fades instead of
    clipping, so the metric clip_frac is 0 (nothing is clipped; ``epsilon`` is unused, accepted
    as upstream does)."""
    name = "sapo"

    def __init__(self, epsilon: float = 0.2, beta: float = 0.0, tau_pos: float = 1.0, tau_neg: float = 1.0,
                 entropy_coef: float = 0.0, ignore_index: int = -100):
        super().__init__(epsilon, None, beta, entropy_coef, ignore_index)
        for key, tau in (("tau_pos", tau_pos), ("tau_neg", tau_neg)):
            if _weight(key, tau) == 0:
                raise ValueError(f"{key} must be > 0, got {tau!r}")
        self.tau_pos, self.tau_neg = float(tau_pos), float(tau_neg)

    def per_token(self, x):
        ratio = self.log_ratio(x).exp()
        adv = x.advantages
        tau = torch.where(adv > 0, torch.full_like(ratio, self.tau_pos), torch.full_like(ratio, self.tau_neg))
        loss = -torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * adv
        if self.beta:
            loss = loss + self.beta * k3(x.logps, x.ref_logps)
        if self.entropy_coef:
            loss = loss - self.entropy_coef * x.entropy
        return loss, torch.zeros_like(x.loss_mask)


class GKDLoss(Loss):
    """GKD (on-policy distillation): the generalized Jensen-Shannon divergence of TRL's
    ``GKDTrainer`` (and upstream Twinkle) between the teacher's and the student's next-token
    distributions, token mean over the loss tokens::

        t = log_softmax(teacher / temperature)       the teacher's log-probs
        s = log_softmax(z_student / temperature)     the student's, over the same support
        beta = 0:      l = KL(T || S)
        beta = 1:      l = KL(S || T)
        otherwise:     log M = logsumexp(s + log(1 - beta), t + log(beta))
                       l = beta * KL(T || M) + (1 - beta) * KL(S || M)
        loss = sum_tokens l / number of tokens

    The teacher is given one of two ways:

    - ``teacher_topk_logps`` (float) and ``teacher_topk_indices`` (int vocabulary ids), each
      ``[B, S, k]`` (or one ``[n_i, k]`` per sample over its loss tokens), aligned as ``logps``
      are: position t is the teacher's distribution of token t given the tokens before it (vLLM's
      ``prompt_logprobs``). The support is the k ids, both sides renormalised over it; the
      student's logits are evaluated at the k ids only (see the module docstring).
    - ``teacher_logits`` ``[B, S, V]`` float, as a model returns them: position t predicts token
      t + 1 (``V`` the model's vocabulary). The support is the whole vocabulary; the divergence is
      computed chunk by chunk over tokens and vocabulary from the student's LM head
      (``LossInputs.teacher_divergence``).

    Positions without a loss are not read. Metric: ``teacher_mass``, the mean of the teacher's
    probability mass on the support (``sum exp(teacher_topk_logps)`` before the temperature; 1 for
    full-vocabulary logits).
    """
    name = "gkd"
    accepts = TEACHER_TOPK + (TEACHER_LOGITS,)
    required = TEACHER_TOPK
    topk_arguments = TEACHER_TOPK
    student_topk = "teacher_topk_indices"
    metric_names = ("teacher_mass",)

    def __init__(self, beta: float = 0.5, temperature: float = 1.0, ignore_index: int = -100):
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta must be in [0, 1] for gkd, got {beta!r}")
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0 \
                or temperature == float("inf"):
            raise ValueError(f"temperature must be a positive number for gkd, got {temperature!r}")
        self.beta = float(beta)
        self.temperature = float(temperature)
        self.ignore_index = ignore_index

    def missing_arguments(self, kwargs: dict):
        """The top-k pair, unless ``teacher_logits`` is given; both ways at once is a ValueError."""
        topk = [k for k in TEACHER_TOPK if kwargs.get(k) is not None]
        if kwargs.get(TEACHER_LOGITS) is not None:
            if topk:
                raise ValueError(f"gkd takes the teacher as teacher_logits or as teacher_topk_logps + "
                                 f"teacher_topk_indices, not both; got teacher_logits and {topk}")
            return []
        return [k for k in TEACHER_TOPK if kwargs.get(k) is None]

    def prepare_argument(self, name, value, labels, loss_mask, vocab_size=None):
        if name == TEACHER_LOGITS:
            return teacher_logits_argument(value, labels, loss_mask, vocab_size)
        if name != "teacher_topk_logps":
            return None    # the ids: topk_argument checks dtype, range and duplicates
        t = topk_argument(name, value, labels, loss_mask)
        # log-probabilities: <= 0, and some of the k finite where a loss is taken (the
        # full-vocabulary teacher refuses the same: the divergence would be NaN)
        if bool((t > 0).any()):
            i, j, c = (int(v) for v in (t > 0).nonzero()[0])
            raise ValueError(f"{name} must hold log-probabilities (<= 0), got {name}[{i}, {j}, {c}] = "
                             f"{float(t[i, j, c])}")
        dead = (t == float("-inf")).all(-1) & loss_mask
        if bool(dead.any()):
            i, j = (int(v) for v in dead.nonzero()[0])
            raise ValueError(f"{name} must not be -inf for all k ids at a loss position (the teacher gives "
                             f"its top k zero probability); {name}[{i}, {j}] is")
        # k distinct ids of one distribution hold at most all of its mass (1e-2 of slack in the
        # log: a teacher's bf16 log-probs round)
        lse = torch.logsumexp(t.double(), -1)
        over = (lse > 1e-2) & loss_mask
        if bool(over.any()):
            i, j = (int(v) for v in over.nonzero()[0])
            raise ValueError(f"{name}: the k probabilities of one position must sum to <= 1, got "
                             f"{math.exp(float(lse[i, j])):.4g} at {name}[{i}, {j}]")
        return t

    def per_token(self, x: LossInputs) -> Tensor:
        """The divergence of each token [N, S] (meaningless where ``loss_mask`` is False)."""
        if x.teacher_divergence is not None:
            return x.teacher_divergence(self.beta, self.temperature)
        if x.student_topk_logits is None:
            raise ValueError("gkd needs LossInputs.student_topk_logits (the loss step computes them "
                             "from teacher_topk_indices) or LossInputs.teacher_divergence (from teacher_logits)")
        s = torch.log_softmax(x.student_topk_logits.float() / self.temperature, -1)
        t = x.extras["teacher_topk_logps"].to(s.dtype)
        t = torch.log_softmax(torch.where(x.loss_mask[..., None], t, torch.zeros_like(t)) / self.temperature, -1)
        if self.beta == 0.0:
            return kl_div(t, s)
        if self.beta == 1.0:
            return kl_div(s, t)
        m = torch.logsumexp(torch.stack([s + math.log(1.0 - self.beta), t + math.log(self.beta)]), 0)
        return self.beta * kl_div(t, m) + (1.0 - self.beta) * kl_div(s, m)

    def __call__(self, x: LossInputs):
        mask = x.loss_mask
        loss = torch.where(mask, self.per_token(x), torch.zeros((), device=mask.device))
        n = mask.sum()
        with torch.no_grad():
            if x.teacher_divergence is not None:
                mass = n.double()           # a full-vocabulary distribution: mass 1 per token
            else:
                mass = x.extras["teacher_topk_logps"].double().exp().sum(-1)
                mass = torch.where(mask, mass, torch.zeros_like(mass)).sum()
        return loss.sum(), n, {"teacher_mass": (mass, n)}


def teacher_logits_argument(value, labels: Tensor, loss_mask: Tensor, vocab_size: Optional[int] = None) -> Tensor:
    """GKD's ``teacher_logits`` ([B, S, V] float, position t predicting token t + 1, as a model
    returns logits) -> [B, S, V] aligned as the other per-token arguments (position t: the
    distribution of token t; the facade shifts them all back by one), in its float dtype, 0 where
    ``loss_mask`` [B, S] is False. ``V`` must be ``vocab_size`` (the student's vocabulary). Bad
    shape, dtype or values (NaN, +inf at a loss position) raise ValueError naming teacher_logits."""
    b, s = labels.shape
    try:
        t = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"teacher_logits must be a float tensor [B, S, V]: {e}") from None
    v = vocab_size if vocab_size is not None else (t.shape[-1] if t.dim() == 3 else None)
    if t.dim() != 3 or tuple(t.shape) != (b, s, v):
        raise ValueError(f"teacher_logits must be [B, S, V] = ({b}, {s}, {v}) (V the model's vocabulary), "
                         f"got shape {tuple(t.shape)}")
    if not t.is_floating_point():
        raise ValueError(f"teacher_logits must be a float tensor, got {t.dtype}")
    # user position t + 1 (the label predicted) holds the logits at t; the last position's are unused
    out = torch.cat([t.new_zeros(b, 1, v), t[:, :-1]], 1)
    out = torch.where(loss_mask[..., None], out, torch.zeros((), dtype=out.dtype))
    if bool(torch.isnan(out).any() | (out == float("inf")).any()):
        raise ValueError("teacher_logits must not be NaN or +inf at the positions predicting a loss token")
    if bool(loss_mask.any()) and bool((out.amax(-1)[loss_mask] == float("-inf")).any()):
        raise ValueError("teacher_logits must not be -inf over the whole vocabulary at a position predicting "
                         "a loss token")
    return out


def kl_div(log_p: Tensor, log_q: Tensor) -> Tensor:
    """KL(P || Q) over the last dimension from log-probabilities; terms with p = 0 (log_p = -inf)
    are 0, with finite gradients."""
    p = log_p.exp()
    return (p * torch.where(p > 0, log_p - log_q, torch.zeros_like(log_p))).sum(-1)


def k3(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """k3 estimator of KL(pi || ref) per token: ``exp(ref - logp) - (ref - logp) - 1``."""
    d = ref_logps - logps
    return d.exp() - d - 1.0


def policy_metrics(x: LossInputs, clipped: Tensor) -> Dict[str, Tuple[Tensor, Tensor]]:
    n = x.loss_mask.sum()
    mask = x.loss_mask
    out = {"clip_frac": ((clipped & mask).float().sum(), n)}
    if x.ref_logps is not None:
        out["kl"] = ((k3(x.logps.detach(), x.ref_logps) * mask).sum(), n)
    if x.entropy is not None:
        out["mean_entropy"] = ((x.entropy.detach() * mask).sum(), n)
    return out


LOSSES = {cls.name: cls for cls in (CrossEntropyLoss, GRPOLoss, DrGRPOLoss, BNPOLoss, GSPOLoss, SimPOLoss,
                                    CISPOLoss, SAPOLoss, DPOLoss, CPOLoss, ORPOLoss, GKDLoss)}
# the user guide's class names and spellings without underscores
_ALIASES = {"crossentropyloss": "cross_entropy", "crossentropy": "cross_entropy", "ce": "cross_entropy",
            "grpoloss": "grpo", "drgrpo": "dr_grpo", "drgrpoloss": "dr_grpo", "bnpoloss": "bnpo",
            "gspoloss": "gspo", "cispoloss": "cispo", "dpoloss": "dpo", "gkdloss": "gkd", "simpoloss": "simpo",
            "cpoloss": "cpo", "orpoloss": "orpo", "sapoloss": "sapo"}


def resolve_loss(loss, **kwargs):
    """A loss object from a name (``"grpo"``, ``"GRPOLoss"``, ...), a class, or an instance."""
    if isinstance(loss, str):
        key = loss.lower().replace("-", "_")
        key = key if key in LOSSES else _ALIASES.get(key.replace("_", ""), key)
        if key not in LOSSES:
            raise ValueError(f"set_loss: unknown loss {loss!r}; known: {sorted(LOSSES)} and task='embedding''s "
                             "'InfonceLoss' (or pass a Loss class or instance)")
        loss = LOSSES[key]
    if isinstance(loss, type):
        try:
            params = inspect.signature(loss.__init__).parameters
        except (TypeError, ValueError):
            params = {}
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        unknown = [k for k in kwargs if k not in params or k == "self"]
        if unknown and not takes_any:
            accepted = [k for k in params if k != "self"]
            raise TypeError(f"set_loss({getattr(loss, 'name', loss.__name__)!r}): unknown argument(s) "
                            f"{unknown}; it takes {accepted}")
        return loss(**kwargs)
    if kwargs:
        raise TypeError(f"set_loss: keyword arguments {sorted(kwargs)} need a loss name or class, "
                        "not an instance")
    if not callable(loss):
        raise TypeError(f"set_loss: expected a loss name, class or callable, got {type(loss).__name__}")
    return loss


def per_token_argument(name: str, value, labels: Tensor, loss_mask: Tensor) -> Tensor:
    """``value`` in the user's layout -> [B, S] fp32 aligned with ``labels`` [B, S].

    Accepted: [B] (one value per row, broadcast), [B, S] (full sequence), or a list of B
    sequences each of length S (full) or of the row's number of loss positions (response-only:
    placed, in order, at the positions where ``loss_mask`` [B, S] is True). Anything else raises
    ValueError naming ``name``.
    """
    b, s = labels.shape
    if isinstance(value, torch.Tensor) and (value.dtype == torch.bool or value.is_complex()):
        raise ValueError(f"{name} must hold real numbers, got dtype {value.dtype}")
    if isinstance(value, torch.Tensor) or (isinstance(value, Sequence) and value and
                                           not isinstance(value[0], (Sequence, torch.Tensor))):
        t = torch.as_tensor(value, dtype=torch.float32)
        if t.dim() == 1 and t.shape[0] == b:
            return _finite_at(name, t[:, None].expand(b, s).clone(), loss_mask)
        if t.dim() == 2 and t.shape == (b, s):
            return _finite_at(name, t.clone(), loss_mask)
        if t.dim() == 2 and t.shape[0] == b:
            value = list(t)     # response-only rows of equal length: checked below
        else:
            raise ValueError(f"{name} must be [B]={b}, [B, S]=({b}, {s}) or one list per sample; "
                             f"got shape {tuple(t.shape)}")
    if not isinstance(value, Sequence) or len(value) != b:
        raise ValueError(f"{name} must have one entry per sample (B={b}), got "
                         f"{len(value) if isinstance(value, Sequence) else type(value).__name__}")
    out = torch.zeros(b, s, dtype=torch.float32)
    for i, row in enumerate(value):
        row = torch.as_tensor(row, dtype=torch.float32).reshape(-1)
        n = int(loss_mask[i].sum())
        if len(row) == s:
            out[i] = row
        elif len(row) == n:
            out[i, loss_mask[i]] = row
        else:
            raise ValueError(f"{name}[{i}] has length {len(row)}: it must be the full sequence "
                             f"length {s} or the number of loss tokens {n} (response-only)")
    return _finite_at(name, out, loss_mask)


def _finite_at(name: str, t: Tensor, loss_mask: Tensor) -> Tensor:
    """``t`` [B, S] checked: a NaN or inf at a loss position (``loss_mask``) is a ValueError
    naming ``name`` and the position; one elsewhere (never read there) becomes 0, since a NaN kept
    there would still poison the backward through ``0 * NaN``."""
    finite = torch.isfinite(t)
    bad = ~finite & loss_mask
    if bool(bad.any()):
        i, j = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"{name} must be finite at the loss positions; {name}[{i}, {j}] = {float(t[i, j])}")
    return t if bool(finite.all()) else torch.where(finite, t, torch.zeros((), dtype=t.dtype))


def topk_argument(name: str, value, labels: Tensor, loss_mask: Tensor, *, integer: bool = False,
                  vocab_size: Optional[int] = None) -> Tensor:
    """``value`` in the user's layout -> [B, S, k] aligned with ``labels`` [B, S]: fp32, or int64
    with ``integer`` (vocabulary ids; each in [0, ``vocab_size``) at the loss positions).

    Accepted: a [B, S, k] tensor (or nested lists), or a list of B per-sample [S, k] (full) or
    [n_i, k] tensors, n_i the row's number of loss positions (response-only: placed, in order,
    where ``loss_mask`` [B, S] is True). Only the loss positions are read: the others become 0.
    Anything else raises ValueError naming ``name``.
    """
    b, s = labels.shape
    dtype = torch.int64 if integer else torch.float32

    def as_tensor(v, what):
        try:
            t = torch.as_tensor(v)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"{what} must be a tensor of shape [B, S, k] ([S, k] or [n_loss, k] per "
                             f"sample): {e}") from None
        if t.dtype == torch.bool or t.is_complex():
            raise ValueError(f"{what} must hold {'integer vocabulary ids' if integer else 'floats'}, "
                             f"got dtype {t.dtype}")
        if integer and t.is_floating_point():
            if not bool((t == t.round()).all()):
                raise ValueError(f"{what} must hold integer vocabulary ids, got {t.dtype} values")
        if not integer and not t.is_floating_point():
            raise ValueError(f"{what} must be a float tensor, got dtype {t.dtype}")
        return t.to(dtype)

    t = value
    if not isinstance(value, torch.Tensor):
        try:
            t = torch.as_tensor(value)      # nested lists of one shape
        except (TypeError, ValueError, RuntimeError):
            t = None                        # one entry per sample, of their own lengths
    if t is not None:
        if t.dim() != 3 or t.shape[0] != b or t.shape[2] < 1:
            raise ValueError(f"{name} must be [B, S, k] = ({b}, {s}, k >= 1) or one [S, k] / [n_loss, k] per "
                             f"sample, got shape {tuple(t.shape)}")
        value = list(t) if t.shape[1] != s else None
    if value is None:
        out = as_tensor(t, name).clone()
    else:
        if not isinstance(value, Sequence) or len(value) != b:
            raise ValueError(f"{name} must be [B, S, k] or one [S, k] / [n_loss, k] per sample (B={b}), got "
                             f"{len(value) if isinstance(value, Sequence) else type(value).__name__}")
        rows = [as_tensor(r, f"{name}[{i}]") for i, r in enumerate(value)]
        ks = {r.shape[-1] for r in rows if r.dim() == 2}
        if any(r.dim() != 2 for r in rows) or len(ks) != 1 or min(ks) < 1:
            raise ValueError(f"{name}: each sample must be [S, k] or [n_loss, k] with one k >= 1, got shapes "
                             f"{[tuple(r.shape) for r in rows]}")
        out = torch.zeros(b, s, ks.pop(), dtype=dtype)
        for i, r in enumerate(rows):
            n = int(loss_mask[i].sum())
            if r.shape[0] == s:
                out[i] = r
            elif r.shape[0] == n:
                out[i, loss_mask[i]] = r
            else:
                raise ValueError(f"{name}[{i}] has {r.shape[0]} positions: it must be the full sequence "
                                 f"length {s} or the number of loss tokens {n} (response-only)")
    out = torch.where(loss_mask[..., None], out, torch.zeros((), dtype=dtype))
    if integer and vocab_size is not None:
        bad = (out < 0) | (out >= vocab_size)
        if bool(bad.any()):
            i = tuple(int(v) for v in bad.nonzero()[0])
            raise ValueError(f"{name} must hold vocabulary ids in [0, {vocab_size}) at the loss positions; "
                             f"{name}{list(i)} = {int(out[i])}")
    if integer:     # one token's k ids are a support: each id once
        srt = out.sort(-1).values
        dup = ((srt[..., 1:] == srt[..., :-1]).any(-1) & loss_mask).nonzero()
        if len(dup):
            i, j = (int(v) for v in dup[0])
            raise ValueError(f"{name}: the k ids of one position must differ, got {out[i, j].tolist()} at "
                             f"{name}[{i}, {j}] (a loss position)")
    if not integer and bool(torch.isnan(out).any() | (out == float("inf")).any()):
        raise ValueError(f"{name} must not be NaN or +inf at the loss positions (-inf is a zero probability)")
    return out
