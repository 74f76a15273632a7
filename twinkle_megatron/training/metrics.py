"""Running metrics of the facade: what :meth:`MegatronModel.calculate_metric` reports, and the
metric objects :meth:`MegatronModel.add_metric` takes in upstream Twinkle's form
(:class:`DPOMetric`, :class:`GRPOMetric`, :class:`GSPOMetric`, :class:`CISPOMetric`,
:class:`Accuracy`), and :class:`CompletionRewardMetric`, upstream's driver-side record of an RL
loop's rewards and completion lengths."""
from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from . import losses, optim


class Meter:
    """Sums over the forward_backward (or forward_only) calls since the last ``read``: the loss
    sum and the count it is normalised by, tokens, seconds, and each loss metric as (sum, count)."""

    def __init__(self):
        self.loss_sum = 0.0
        self.count = 0.0
        self.tokens = 0
        self.seconds = 0.0
        self.metrics = {}
        self.grad_norm = float("nan")
        self.last_loss = float("nan")
        self.maxima = set()
        self.totals = set()

    def add_fb(self, loss_sum, count, tokens, seconds, metrics=None, max_names=frozenset(),
               total_names=frozenset()):
        """``max_names``: the metrics kept as their maximum (of values >= 0), not a sum;
        ``total_names``: those reported as their sum, not divided by their count."""
        self.loss_sum += loss_sum
        self.count += count
        self.tokens += tokens
        self.seconds += seconds
        self.totals.update(total_names)
        for name, (total, n) in (metrics or {}).items():
            acc = self.metrics.setdefault(name, [0.0, 0.0])
            if name in max_names:
                self.maxima.add(name)
                acc[0] = max(acc[0], total) if n else acc[0]
            else:
                acc[0] += total
            acc[1] += n

    def read(self, *, lr, step, is_training):
        if self.count:
            self.last_loss = self.loss_sum / self.count
        out = {"loss": self.last_loss, "grad_norm": self.grad_norm, "lr": lr,
               "tokens_per_s": self.tokens / self.seconds if self.seconds else 0.0,
               "num_tokens": self.tokens, "step": step,
               # upstream Twinkle's names of the same values (its TrainMetric's; numbers here, not
               # its formatted strings)
               "learning rate": lr, "iters": step}
        out.update({n: total if n in self.maxima or n in self.totals else total / c
                    for n, (total, c) in self.metrics.items() if c})
        if not is_training:
            out.pop("grad_norm")
        self.loss_sum, self.count, self.tokens, self.seconds, self.metrics = 0.0, 0.0, 0, 0.0, {}
        return out


_RESERVED = ("loss", "count", "num_tokens", "grad_norm", "lr", "tokens_per_s", "step", "aux_loss",
             "logps", "entropy", "learning rate", "iters")


def check_metric(name, fn) -> None:
    """The arguments of :meth:`MegatronModel.add_metric`."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"add_metric: name must be a non-empty str, got {name!r}")
    if name in _RESERVED:
        raise ValueError(f"add_metric: name={name!r} is reported by the facade already; pick another")
    if not callable(fn):
        raise TypeError(f"add_metric: fn must be callable (LossInputs -> (sum, count)), got {type(fn).__name__}")


class Metric:
    """A metric object on the (sum, count) contract of a loss's metrics, several keys at once:
    ``self(x)`` gets each micro-batch's :class:`~twinkle_megatron.training.losses.LossInputs` and
    returns ``{key: (sum, count)}`` for keys among ``names`` (a key left out, or given a count of
    0, is not reported); the facade adds sums and counts over micro-batches, calls and DP ranks
    and reports ``sum / count``; for the keys in ``max_names`` ``sum`` is the micro-batch's
    maximum of a quantity >= 0, and the facade keeps the maximum (the count still summed); the
    keys in ``total_names`` are reported as their summed ``sum`` (a total, such as a token count).
    ``derive(values)``: keys computed from the reported ones at
    :meth:`MegatronModel.calculate_metric` (e.g. an exponential of a mean). ``needs_entropy``:
    whether ``x.entropy`` must be computed (else it is there when the loss or the call asked);
    ``needs_argmax``: whether ``x.argmax_correct`` must be (the top 1 of the vocabulary per token).
    ``task``: the calls it reports in: ``"causal_lm"`` (``x`` a LossInputs) or ``"embedding"``
    (``x`` a :class:`SentenceInputs`)."""
    names: Tuple[str, ...] = ()
    max_names: Tuple[str, ...] = ()
    total_names: Tuple[str, ...] = ()
    task: str = "causal_lm"
    needs_entropy: bool = False
    needs_argmax: bool = False

    def __call__(self, x: losses.LossInputs) -> Dict[str, tuple]:
        raise NotImplementedError

    def derive(self, values: Dict[str, float]) -> Dict[str, float]:
        return {}


def _ignore_index(cls, ignore_index):
    # the metric reads the loss's loss_mask: a different ignore_index here would be ignored
    if ignore_index != -100:
        raise ValueError(f"{cls}: ignore_index={ignore_index!r}: the metric counts the positions of the loss's "
                         "loss_mask; set ignore_index on the loss (set_loss) instead")


class DPOMetric(Metric):
    """Upstream Twinkle's (TRL's) DPO metrics, pairs as for
    :class:`~twinkle_megatron.training.losses.DPOLoss` (sequences 2k chosen, 2k + 1 rejected of
    each micro-batch; an odd number is a ValueError)::

        pi_i = sum_{t in seq i} logp_t,  ref_i likewise over ref_logps,  w_i = beta * (pi_i - ref_i)
        'logps/chosen', 'logps/rejected':          mean over pairs of pi_2k, pi_2k+1
        'logps/ref_chosen', 'logps/ref_rejected':  mean of ref_2k, ref_2k+1
        'rewards/chosen', 'rewards/rejected':      mean of w_2k, w_2k+1
        'rewards/margins':                         mean of w_2k - w_2k+1
        'rewards/accuracies':                      100 * fraction of pairs with w_2k - w_2k+1 > 0

    The ref and reward keys need ``ref_logps`` given to the call (and accepted by its loss);
    without them only the two ``logps/`` keys are reported, as upstream. Numbers here, not
    upstream's formatted strings (``'rewards/accuracies'`` in percent, as its ``'62.5%'``)."""
    names = ("logps/chosen", "logps/rejected", "logps/ref_chosen", "logps/ref_rejected", "rewards/chosen",
             "rewards/rejected", "rewards/margins", "rewards/accuracies")

    def __init__(self, beta: float = 0.1, ignore_index: int = -100):
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not math.isfinite(beta):
            raise ValueError(f"DPOMetric: beta must be a finite number, got {beta!r}")
        _ignore_index("DPOMetric", ignore_index)
        self.beta = float(beta)

    def __call__(self, x):
        keep = losses.preference_pairs(x, "DPOMetric")
        pi = x.segment_sum(x.logps.detach().double())[keep]
        pairs = len(pi) // 2
        out = {"logps/chosen": (pi[0::2].sum(), pairs), "logps/rejected": (pi[1::2].sum(), pairs)}
        if x.ref_logps is not None:
            ref = x.segment_sum(x.ref_logps.double())[keep]
            w = self.beta * (pi - ref)
            margin = w[0::2] - w[1::2]
            out.update({"logps/ref_chosen": (ref[0::2].sum(), pairs), "logps/ref_rejected": (ref[1::2].sum(), pairs),
                        "rewards/chosen": (w[0::2].sum(), pairs), "rewards/rejected": (w[1::2].sum(), pairs),
                        "rewards/margins": (margin.sum(), pairs),
                        "rewards/accuracies": (100.0 * (margin > 0).double().sum(), pairs)})
        return out


class GRPOMetric(Metric):
    """Upstream Twinkle's GRPO metrics, token means over the loss tokens of the batch, with
    ``new = temperature * logp`` and ``old = temperature * old_logps`` (upstream's rescaling to the
    log-probs at temperature 1 when the sampler's ``temperature`` is given) and ``d = new - old``::

        'train/mean_new_logp'     mean of new;  'train/policy_confidence' = exp of it
        'train/mean_old_logp'     mean of old                                      (with old_logps)
        'train/logp_diff_mean'    mean of d                                        (with old_logps)
        'train/approx_kl'         mean of exp(d) - d - 1 (k3 of KL(old || new))    (with old_logps)
        'train/token_kl_max'      the largest exp(d) - d - 1 of a token            (with old_logps)
        'train/token_ratio_max'   the largest exp(d) of a token                    (with old_logps)
        'train/clip_ratio_low'    fraction of tokens with r < 1 - epsilon and A < 0 (r = exp(d);
        'train/clip_ratio_high'   fraction with r > 1 + epsilon_high and A > 0      with old_logps
        'train/clip_ratio'        the sum of the two                                and advantages)
        'train/entropy'           mean token entropy (when computed: an entropy loss term or
                                  return_entropy=True)

    ``old_logps`` / ``advantages``: those given to the call and accepted by its loss. Not reported
    here: upstream's ``top_k_kl`` records (``top_k_kl > 0`` is a ValueError)."""
    names = ("train/mean_new_logp", "train/mean_old_logp", "train/logp_diff_mean", "train/approx_kl",
             "train/token_kl_max", "train/token_ratio_max",
             "train/clip_ratio_low", "train/clip_ratio_high", "train/clip_ratio", "train/entropy")
    max_names = ("train/token_kl_max", "train/token_ratio_max")

    def __init__(self, temperature: float = 1.0, epsilon: float = 0.2, epsilon_high: Optional[float] = None,
                 top_k_kl: int = 0, ignore_index: int = -100):
        cls = type(self).__name__
        for key, v in (("temperature", temperature), ("epsilon", epsilon),
                       ("epsilon_high", epsilon if epsilon_high is None else epsilon_high)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise ValueError(f"{cls}: {key} must be a finite number >= 0, got {v!r}")
        if top_k_kl:
            raise ValueError(f"{cls}: top_k_kl={top_k_kl!r} (upstream's per-token records of the largest KL) is not "
                             "supported; use forward_backward(return_logps=True) and old_logps to find them")
        _ignore_index(cls, ignore_index)
        self.temperature, self.epsilon = float(temperature), float(epsilon)
        self.epsilon_high = float(epsilon if epsilon_high is None else epsilon_high)

    def clipped(self, x, d: torch.Tensor, mask: torch.Tensor):
        """-> ((low, high) [N, S] bool, count): the clipped tokens by the sign of the advantage."""
        ratio, adv = d.exp(), x.advantages.double()
        return ((ratio < 1 - self.epsilon) & (adv < 0) & mask, (ratio > 1 + self.epsilon_high) & (adv > 0) & mask,
                mask.sum())

    def __call__(self, x):
        mask = x.loss_mask
        n = mask.sum()
        zero = torch.zeros((), dtype=torch.float64, device=mask.device)
        scale = self.temperature if self.temperature > 0 else 1.0   # upstream: 0 leaves them as they are
        new = torch.where(mask, x.logps.detach().double() * scale, zero)
        out = {"train/mean_new_logp": (new.sum(), n)}
        if x.entropy is not None:
            out["train/entropy"] = (torch.where(mask, x.entropy.detach().double(), zero).sum(), n)
        if x.old_logps is None:
            return out
        old = torch.where(mask, x.old_logps.double() * scale, zero)
        d = new - old
        kl = torch.where(mask, d.exp() - d - 1, zero)
        out.update({"train/mean_old_logp": (old.sum(), n), "train/logp_diff_mean": (d.sum(), n),
                    "train/approx_kl": (kl.sum(), n), "train/token_kl_max": (kl.max(), n),
                    "train/token_ratio_max": (torch.where(mask, d.exp(), zero).max(), n)})
        if x.advantages is not None:
            low, high, count = self.clipped(x, d, mask)
            low, high = low.double().sum(), high.double().sum()
            out.update({"train/clip_ratio_low": (low, count), "train/clip_ratio_high": (high, count),
                        "train/clip_ratio": (low + high, count)})
        return out

    def derive(self, values):
        mean = values.get("train/mean_new_logp")
        return {} if mean is None else {"train/policy_confidence": math.exp(mean)}


class GSPOMetric(GRPOMetric):
    """:class:`GRPOMetric` with GSPO's sequence-level clipping: per sequence (a row, or a packed
    sample) ``s = exp(mean_t d_t)`` and its mean advantage ``a``; the clip ratios are fractions of
    the sequences with ``s < 1 - epsilon, a < 0`` / ``s > 1 + epsilon_high, a > 0``."""

    def clipped(self, x, d, mask):
        tokens = x.segment_tokens().double()
        valid = tokens > 0
        s = (x.segment_sum(d) / tokens.clamp(min=1)).exp()
        a = x.segment_sum(x.advantages.double()) / tokens.clamp(min=1)
        return ((s < 1 - self.epsilon) & (a < 0) & valid, (s > 1 + self.epsilon_high) & (a > 0) & valid,
                valid.sum())


class CISPOMetric(GRPOMetric):
    """:class:`GRPOMetric` with CISPO's clipping, whatever the sign of the advantage: the fractions
    of tokens with ``r < 1 - epsilon`` / ``r > 1 + epsilon_high``."""

    def clipped(self, x, d, mask):
        ratio = d.exp()
        return (ratio < 1 - self.epsilon) & mask, (ratio > 1 + self.epsilon_high) & mask, mask.sum()


class Accuracy(Metric):
    """Upstream Twinkle's token accuracy: over the loss positions (labels not -100; position 0 is
    never predicted), the fraction whose label is the argmax of the model's logits that predict it
    (the logits at the position before, as ``logps``)::

        'accuracy'         correct / total  (a fraction; upstream formats it as '0.42')
        'correct_tokens'   the number of correct positions  (totals, summed over micro-batches,
        'total_tokens'     the number of loss positions      calls and data-parallel ranks)

    The argmax runs over the whole vocabulary, without the ``[tokens, V]`` logits on the fused
    LM-head path, vocab-parallel under TP (the top 1 of
    :func:`~twinkle_megatron.training.loss_step.token_topk`). Upstream's ``completion_mask`` is not
    read: the positions are the loss's ``loss_mask``. ``ignore_index`` other than -100 is a
    ValueError (set it on the loss)."""
    names = ("accuracy", "correct_tokens", "total_tokens")
    total_names = ("correct_tokens", "total_tokens")
    needs_argmax = True

    def __init__(self, ignore_index: int = -100):
        _ignore_index("Accuracy", ignore_index)

    def __call__(self, x):
        if x.argmax_correct is None:
            raise RuntimeError("Accuracy: LossInputs.argmax_correct was not computed (the call's metrics "
                               "did not set needs_argmax)")
        n = x.loss_mask.sum().double()
        correct = (x.argmax_correct & x.loss_mask).sum().double()
        return {"accuracy": (correct, n), "correct_tokens": (correct, n), "total_tokens": (n, n)}


@dataclasses.dataclass
class SentenceInputs:
    """What an ``"embedding"`` metric reads of a micro-batch of ``task='embedding'``: the sentence
    ``embeddings`` [n, H] (unit vectors, no gradient) over every data-parallel rank, in rank
    order, and their group ``labels`` [n] int64 (1 starts a group: its anchor; 0 continues it)."""
    embeddings: torch.Tensor
    labels: torch.Tensor


class EmbeddingMetric(Metric):
    """Upstream Twinkle's metric of ``task='embedding'`` (InfoNCE training): over each
    micro-batch's sentences on every data-parallel rank, each anchor (label 1) and the sentence
    after it (its positive)::

        'pos_sim'                    mean cosine similarity of the anchor-positive pairs
        'pos_sim_min', 'pos_sim_max' the smallest / largest of them
        'neg_sim'                    mean similarity of each anchor to the other pairs'
                                     positives (the in-batch negatives; with two pairs or more)

    pooled over micro-batches and calls (``'loss'`` and ``'grad_norm'``, upstream's other keys, are
    the facade's own). Numbers, not upstream's formatted strings."""
    names = ("pos_sim", "pos_sim_min", "pos_sim_max", "neg_sim")
    # kept as maxima of 1 - cos / 1 + cos (>= 0, the reduction's convention), read back by derive
    max_names = ("pos_sim_min", "pos_sim_max")
    task = "embedding"

    def __call__(self, x):
        emb, labels = x.embeddings.double(), x.labels
        anchors = torch.nonzero(labels == 1).reshape(-1)
        anchors = anchors[anchors + 1 < len(labels)]
        if not len(anchors):
            return {}
        a, p = emb[anchors], emb[anchors + 1]
        cos = F.cosine_similarity(a, p, dim=1)
        n = len(cos)
        out = {"pos_sim": (cos.sum(), n), "pos_sim_min": ((1 - cos).max(), n), "pos_sim_max": ((1 + cos).max(), n)}
        if n > 1:
            off = ~torch.eye(n, dtype=torch.bool, device=emb.device)
            out["neg_sim"] = ((a @ p.T)[off].sum(), n * (n - 1))
        return out

    def derive(self, values):
        out = {}
        if "pos_sim_min" in values:
            out["pos_sim_min"] = 1.0 - values["pos_sim_min"]
        if "pos_sim_max" in values:
            out["pos_sim_max"] = values["pos_sim_max"] - 1.0
        return out


class CompletionRewardMetric:
    """Upstream Twinkle's record of an RL loop's sampling side, kept by the training script (not
    given to :meth:`MegatronModel.add_metric`: nothing of it passes through the model)::

        m = CompletionRewardMetric()
        m.accumulate(rewards={'accuracy': [1.0, 0.0], 'format': [0.5, 1.0]},
                     completion_lengths=[37, 52], generate_time=2.1, weight_sync_time=0.4)
        m.calculate()   # {'train/accuracy_reward': 0.5, 'train/accuracy_reward_std': 0.707..., ...}

    ``calculate()``: per reward name ``'train/<name>_reward'`` (the mean of every value given
    since the last ``reset()``) and ``'train/<name>_reward_std'`` (the sample standard deviation,
    n - 1; 0 for fewer than two values), ``'train/completion_length'`` (mean),
    ``'profiling/Time taken: generate'`` and ``'profiling/Time taken: move_model_to_sampler'``
    (means of the times given); a key with nothing recorded is left out. ``calculate`` does not
    reset (upstream's scripts call ``reset()`` themselves). ``inputs`` / ``outputs`` (upstream's
    positional arguments) are ignored. Floats, not upstream's formatted strings. ``rewards`` not a
    dict, or values that are not numbers, is a TypeError; a non-finite value a ValueError; a bad
    call records nothing."""

    def __init__(self, device_mesh=None, process_group=None, **kwargs):
        # upstream's constructor arguments; it gathers nothing across ranks either
        self.reset()

    def reset(self) -> None:
        self.generate_time, self.weight_sync_time, self.completion_lengths = [], [], []
        self.rewards: Dict[str, list] = {}

    @staticmethod
    def _numbers(name, values) -> list:
        if torch.is_tensor(values):
            values = values.reshape(-1).tolist()
        try:
            out = [float(v) for v in values]
        except (TypeError, ValueError):
            raise TypeError(f"CompletionRewardMetric: {name} must be a sequence of numbers, got {values!r}") from None
        if not all(math.isfinite(v) for v in out):
            raise ValueError(f"CompletionRewardMetric: {name} has a non-finite value: {out}")
        return out

    def accumulate(self, inputs=None, outputs=None, *, rewards: Optional[Dict[str, list]] = None,
                   completion_lengths=None, generate_time: Optional[float] = None,
                   weight_sync_time: Optional[float] = None, **kwargs) -> None:
        if rewards is not None and not isinstance(rewards, dict):
            raise TypeError(f"CompletionRewardMetric: rewards must be a dict of name -> values, got "
                            f"{type(rewards).__name__}")
        new = {k: self._numbers(f"rewards[{k!r}]", v) for k, v in (rewards or {}).items()}
        lengths = self._numbers("completion_lengths", [] if completion_lengths is None else completion_lengths)
        gen = None if generate_time is None else self._numbers("generate_time", [generate_time])[0]
        sync = None if weight_sync_time is None else self._numbers("weight_sync_time", [weight_sync_time])[0]
        for k, v in new.items():     # everything checked before anything is recorded
            self.rewards.setdefault(k, []).extend(v)
        self.completion_lengths.extend(lengths)
        if gen is not None:
            self.generate_time.append(gen)
        if sync is not None:
            self.weight_sync_time.append(sync)

    def calculate(self) -> Dict[str, float]:
        def mean(v):
            return math.fsum(v) / len(v)

        def std(v):
            if len(v) < 2:
                return 0.0
            m = mean(v)
            return math.sqrt(math.fsum((x - m) ** 2 for x in v) / (len(v) - 1))
        out = {}
        if self.weight_sync_time:
            out["profiling/Time taken: move_model_to_sampler"] = mean(self.weight_sync_time)
        if self.generate_time:
            out["profiling/Time taken: generate"] = mean(self.generate_time)
        for k, v in self.rewards.items():
            if v:
                out[f"train/{k}_reward"] = mean(v)
                out[f"train/{k}_reward_std"] = std(v)
        if self.completion_lengths:
            out["train/completion_length"] = mean(self.completion_lengths)
        return out


METRICS = {cls.__name__: cls for cls in (DPOMetric, GRPOMetric, GSPOMetric, CISPOMetric, Accuracy, EmbeddingMetric)}


def resolve_metric(metric, kwargs: dict) -> Metric:
    """A :class:`Metric` from upstream Twinkle's forms: a registered class name (``"DPOMetric"``,
    case-insensitive), a :class:`Metric` subclass (built with ``kwargs``) or an instance."""
    if isinstance(metric, str):
        found = {k.lower(): v for k, v in METRICS.items()}.get(metric.lower())
        if found is None:
            raise ValueError(f"add_metric: unknown metric {metric!r}; known: {sorted(METRICS)} (or pass "
                             "add_metric(name, fn) with fn(LossInputs) -> (sum, count))")
        metric = found
    if isinstance(metric, type) and issubclass(metric, Metric):
        params = inspect.signature(metric.__init__).parameters
        unknown = sorted(k for k in kwargs if k not in params or k == "self")
        if unknown:
            raise TypeError(f"add_metric({metric.__name__}): unknown argument(s) {unknown}; it takes "
                            f"{[k for k in params if k != 'self']}")
        return metric(**kwargs)
    if isinstance(metric, Metric):
        if kwargs:
            raise TypeError(f"add_metric: keyword arguments {sorted(kwargs)} need a metric name or class, "
                            "not an instance")
        return metric
    raise TypeError(f"add_metric: expected a name and fn, a metric name, a Metric class or instance; got "
                    f"{metric!r}")


def register(user_metrics: dict, name, fn, *, needs_entropy: bool, is_training, kwargs: dict) -> None:
    """:meth:`MegatronModel.add_metric` into ``user_metrics`` (``key -> (fn or Metric,
    needs_entropy, is_training)``): ``(name, fn)`` or upstream's ``(metric, **kwargs)``."""
    if is_training not in (None, True, False):
        raise TypeError(f"add_metric: is_training must be None (both), True or False, got {is_training!r}")
    if fn is None or isinstance(fn, bool):
        if isinstance(fn, bool):    # upstream's add_metric(metric_cls, is_training)
            if is_training is not None:
                raise TypeError("add_metric: is_training given twice")
            is_training = fn
        obj = resolve_metric(name, kwargs)
        key, names, needs = type(obj).__name__, tuple(obj.names), bool(obj.needs_entropy or needs_entropy)
        entry = obj
    else:
        if kwargs:
            raise TypeError(f"add_metric(name, fn): unknown keyword argument(s) {sorted(kwargs)}")
        check_metric(name, fn)
        key, names, needs, entry = name, (name,), bool(needs_entropy), fn
    taken = {n: k for k, (f, *_) in user_metrics.items() if k != key
             for n in (f.names if isinstance(f, Metric) else (k,))}
    clash = sorted(n for n in names if n in taken)
    if clash:
        raise ValueError(f"add_metric: {clash} are reported by the metric {taken[clash[0]]!r} already")
    user_metrics[key] = (entry, needs, is_training)


def applies(entry: tuple, training: bool, task: Optional[str] = "causal_lm") -> bool:
    """Whether a ``user_metrics`` entry reports in a training (``forward_backward``) or an
    evaluation (``forward_only``) call of ``task`` (a metric object's ``task``; a ``(name, fn)``
    metric is a causal LM one; None: any task)."""
    when = entry[2] if len(entry) > 2 else None
    mine = getattr(entry[0], "task", "causal_lm") if isinstance(entry[0], Metric) else "causal_lm"
    return (when is None or when == training) and (task is None or mine == task)


def derived(user_metrics: dict, values: dict, training: bool) -> dict:
    """The keys the metric objects of ``user_metrics`` derive from the reported ``values``."""
    out = {}
    for entry in user_metrics.values():
        if isinstance(entry[0], Metric) and applies(entry, training, task=None):
            out.update(entry[0].derive(values))
    return out


class WithMetrics:
    """``loss`` (the :mod:`twinkle_megatron.training.losses` interface) that also reports the user's
    metrics: each ``fn(inputs)`` gets the micro-batch's :class:`~twinkle_megatron.training.losses.LossInputs`
    (per-token ``logps``, ``loss_mask``, ``entropy``, the per-sample arguments) and returns
    ``(sum, count)``; the facade adds both over micro-batches, calls and DP ranks and reports
    ``sum / count``, exactly like a loss's own metrics. Computed without gradients."""

    def __init__(self, loss, metrics: dict):
        own = tuple(getattr(loss, "metric_names", ()))
        names = tuple(n for k, (fn, *_) in metrics.items() for n in (fn.names if isinstance(fn, Metric) else (k,)))
        clash = sorted(set(own) & set(names))
        if clash:
            raise ValueError(f"add_metric: {clash} clash with the metrics of the loss {getattr(loss, 'name', loss)!r}")
        self.inner = loss
        self.user = dict(metrics)
        self.metric_names = own + names
        self.max_metric_names = frozenset(getattr(loss, "max_metric_names", ())) | frozenset(
            n for fn, *_ in metrics.values() if isinstance(fn, Metric) for n in fn.max_names)
        self.total_metric_names = frozenset(getattr(loss, "total_metric_names", ())) | frozenset(
            n for fn, *_ in metrics.values() if isinstance(fn, Metric) for n in fn.total_names)
        self.needs_argmax = bool(getattr(loss, "needs_argmax", False)) or any(
            fn.needs_argmax for fn, *_ in metrics.values() if isinstance(fn, Metric))
        self.needs_entropy = bool(getattr(loss, "needs_entropy", False)) or any(
            entry[1] for entry in self.user.values())

    def __getattr__(self, key):   # accepts, required, ignore_index, name, ...
        return getattr(self.__dict__["inner"], key)

    def __call__(self, inputs):
        result = self.inner(inputs)
        if not isinstance(result, tuple) or len(result) not in (2, 3):
            return result   # the loss step raises on it
        metrics = dict(result[2]) if len(result) == 3 else {}
        with torch.no_grad():
            for name, (fn, *_) in self.user.items():
                out = fn(inputs)
                if isinstance(fn, Metric):
                    if not isinstance(out, dict) or set(out) - set(fn.names):
                        raise TypeError(f"metric {name!r} must return {{key: (sum, count)}} for keys among "
                                        f"{list(fn.names)}, got {out if isinstance(out, dict) else type(out).__name__}")
                    metrics.update(out)
                    continue
                if not isinstance(out, tuple) or len(out) != 2:
                    raise TypeError(f"metric {name!r} must return (sum, count), got {type(out).__name__}")
                metrics[name] = out
        return result[0], result[1], metrics


def describe(model, states) -> str:
    """``get_train_configs``' text: ``model`` (the facade)'s model, mesh and precision, then for
    each of ``states`` (the adapters' or the base's train state) its optimizer, LoRA settings and
    LR schedule."""
    m, s = model.mesh, model.shape
    lines = [
        f"model: {s.model_type} layers={s.num_layers} hidden={s.hidden_size} heads={s.num_heads}"
        f"/{s.num_kv_heads} vocab={s.vocab_size}" + (f" experts={s.num_experts} top{s.moe_topk}" if s.num_experts else ""),
        f"mesh: world={m.world_size} dp={m.dp_size} tp={m.tp_size} pp={m.pp_size} vpp={m.vpp_size} "
        f"cp={m.cp_size} ep={m.ep_size} etp={m.etp_size} sp={m.sequence_parallel}",
        f"precision: {model.mixed_precision} device: {model.device}",
        paths_line(model),
        recompute_line(model.config),
    ]
    for state in states:
        if getattr(model, "overlap", None) is not None:
            wrapped = state.ddp_config
            lines.append(model.overlap.describe(None if wrapped is None else wrapped.use_distributed_optimizer))
        if state.optimizer is not None:
            c = state.opt_config
            lines.append(f"optimizer: AdamW lr={c.lr} wd={c.weight_decay} betas=({c.adam_beta1}, "
                         f"{c.adam_beta2}) distributed={c.use_distributed_optimizer} "
                         f"implementation={_optimizer_implementation(state)}")
        if state.name is not None:
            a = model.adapters[state.name]
            trainable, total, c = a.trainable_params, a.total_params, a.config
            lines.append(f"adapter {a.name!r}: LoRA r={c.r} alpha={c.lora_alpha} "
                         f"modules={len(a.targets)} accumulation={a.gradient_accumulation_steps}; "
                         f"trainable params {trainable} / {total} ({100 * trainable / max(total, 1):.3f}%)")
        if state.lr_scheduler is not None:
            sch = state.lr_scheduler
            lines.append(f"lr scheduler: {sch.lr_decay_style} warmup={sch.lr_warmup_steps} "
                         f"steps={sch.lr_decay_steps}")
    return "\n".join(lines)


def paths_line(model) -> str:
    """The ``paths:`` line of ``get_train_configs``: which implementation runs the layers (the
    twinkle_kernels spec and the backend its ops pick on the model's device, or megatron's local
    modules) and the LM head's loss (fused linear cross-entropy, or logits then cross-entropy)."""
    if model.use_twinkle_kernels:
        import twinkle_kernels
        layers = f"twinkle_kernels ({twinkle_kernels.default_backend(model.device)} backend)"
    else:
        layers = "megatron local modules"
    head = "fused linear cross-entropy" if model.fused_linear_ce else "logits + cross-entropy"
    return f"paths: layers={layers} lm_head_loss={head}"


def recompute_line(config) -> str:
    """The ``recompute:`` line of ``get_train_configs`` for megatron's ``TransformerConfig``."""
    if config.recompute_granularity is None:
        return "recompute: off"
    if config.recompute_granularity == "full":
        return f"recompute: full method={config.recompute_method} layers={config.recompute_num_layers}"
    return f"recompute: selective modules={','.join(config.recompute_modules)}"


def _optimizer_implementation(state) -> str:
    """Which kernel steps ``state``'s optimizer in ``clip_grad_and_step``."""
    from . import fused_adam
    if state.fused_step and fused_adam.eligible(state):
        opts = optim.megatron_optimizers(state.optimizer)
        if any(getattr(o, "float16_groups", None) for o in opts):   # mixed precision: a model copy
            return "twinkle adamw_step (cpu: scale, clip, AdamW and the bf16 copy in one pass)"
        return "twinkle adamw_step (cpu: scale, clip and AdamW in one pass)"
    return optim.implementation(state.optimizer)
