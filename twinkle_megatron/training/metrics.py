"""Running metrics of the facade: what :meth:`MegatronModel.calculate_metric` reports."""
from __future__ import annotations

import torch


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

    def add_fb(self, loss_sum, count, tokens, seconds, metrics=None):
        self.loss_sum += loss_sum
        self.count += count
        self.tokens += tokens
        self.seconds += seconds
        for name, (total, n) in (metrics or {}).items():
            acc = self.metrics.setdefault(name, [0.0, 0.0])
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
        out.update({n: total / c for n, (total, c) in self.metrics.items() if c})
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


class WithMetrics:
    """``loss`` (the :mod:`twinkle_megatron.training.losses` interface) that also reports the user's
    metrics: each ``fn(inputs)`` gets the micro-batch's :class:`~twinkle_megatron.training.losses.LossInputs`
    (per-token ``logps``, ``loss_mask``, ``entropy``, the per-sample arguments) and returns
    ``(sum, count)``; the facade adds both over micro-batches, calls and DP ranks and reports
    ``sum / count``, exactly like a loss's own metrics. Computed without gradients."""

    def __init__(self, loss, metrics: dict):
        own = tuple(getattr(loss, "metric_names", ()))
        clash = sorted(set(own) & set(metrics))
        if clash:
            raise ValueError(f"add_metric: {clash} clash with the metrics of the loss {getattr(loss, 'name', loss)!r}")
        self.inner = loss
        self.user = dict(metrics)
        self.metric_names = own + tuple(self.user)
        self.needs_entropy = bool(getattr(loss, "needs_entropy", False)) or any(
            needs for _, needs in self.user.values())

    def __getattr__(self, key):   # accepts, required, ignore_index, name, ...
        return getattr(self.__dict__["inner"], key)

    def __call__(self, inputs):
        result = self.inner(inputs)
        if not isinstance(result, tuple) or len(result) not in (2, 3):
            return result   # the loss step raises on it
        metrics = dict(result[2]) if len(result) == 3 else {}
        with torch.no_grad():
            for name, (fn, _) in self.user.items():
                out = fn(inputs)
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
        recompute_line(model.config),
    ]
    for state in states:
        if getattr(model, "overlap", None) is not None:
            wrapped = state.ddp_config
            lines.append(model.overlap.describe(None if wrapped is None else wrapped.use_distributed_optimizer))
        if state.optimizer is not None:
            c = state.opt_config
            lines.append(f"optimizer: AdamW lr={c.lr} wd={c.weight_decay} betas=({c.adam_beta1}, "
                         f"{c.adam_beta2}) distributed={c.use_distributed_optimizer}")
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


def recompute_line(config) -> str:
    """The ``recompute:`` line of ``get_train_configs`` for megatron's ``TransformerConfig``."""
    if config.recompute_granularity is None:
        return "recompute: off"
    if config.recompute_granularity == "full":
        return f"recompute: full method={config.recompute_method} layers={config.recompute_num_layers}"
    return f"recompute: selective modules={','.join(config.recompute_modules)}"
