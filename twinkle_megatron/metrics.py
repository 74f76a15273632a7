"""Running metrics of the facade: what :meth:`MegatronModel.calculate_metric` reports."""
from __future__ import annotations


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
               "num_tokens": self.tokens, "step": step}
        out.update({n: total / c for n, (total, c) in self.metrics.items() if c})
        if not is_training:
            out.pop("grad_norm")
        self.loss_sum, self.count, self.tokens, self.seconds, self.metrics = 0.0, 0.0, 0, 0.0, {}
        return out
