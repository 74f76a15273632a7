"""The ``fused_linear_cross_entropy`` patch of ``*ForCausalLM``: the training loss straight from the
last hidden states, without the [B, S, V] logits.

The patched forward runs the original forward (so everything a family adds around the loss, such
as the MoE router's auxiliary loss, and everything that comes before, stays transformers' own)
with two substitutions for the length of the call: ``lm_head`` passes the hidden states through,
and ``loss_function`` is transformers' causal-LM loss (shift, ``ignore_index``,
``num_items_in_batch``, ``shift_labels``) computed by ``twinkle_kernels.fused_linear_cross_entropy``
against ``lm_head.weight``. The returned ``logits`` are then ``None``.

The fused path is taken only in training mode with ``labels``; otherwise (evaluation, generation,
no labels) the original forward runs untouched and returns its logits.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

_MISSING = object()


def _tk():
    import twinkle_kernels
    return twinkle_kernels


class _HiddenPassthrough(nn.Module):
    """Stands in for ``lm_head`` during a fused call: the "logits" it returns are the hidden states."""

    def forward(self, hidden_states):
        return hidden_states


def _head_reason(head) -> Optional[str]:
    if type(head) is not nn.Linear:
        return f"lm_head is {type(head).__name__}, not a plain nn.Linear (an adapter or wrapper around it)"
    if head._forward_hooks or head._forward_pre_hooks:
        return "lm_head has forward hooks"
    return None


def _causal_lm_loss(head: nn.Linear, backend):
    """transformers' ``ForCausalLMLoss`` with the hidden states in place of the logits."""

    def loss_function(logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index: int = -100,
                      shift_labels=None, **kwargs):
        hidden = logits
        if shift_labels is None:
            labels = nn.functional.pad(labels, (0, 1), value=ignore_index)
            shift_labels = labels[..., 1:]
        shift_labels = shift_labels.reshape(-1).to(hidden.device)
        hidden = hidden.reshape(-1, hidden.shape[-1])
        reduction = "sum" if num_items_in_batch is not None else "mean"
        w = head.weight
        loss = _tk().fused_linear_cross_entropy(hidden.to(w.dtype), w, shift_labels, bias=head.bias,
                                                ignore_index=ignore_index, reduction=reduction, backend=backend)
        if reduction == "sum":
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss / num_items_in_batch
        return loss

    return loss_function


class FusedLinearCrossEntropy:
    """``*ForCausalLM.forward`` -> the loss by ``twinkle_kernels.fused_linear_cross_entropy``."""
    op = "fused_linear_cross_entropy"

    @staticmethod
    def op_reason():
        if callable(getattr(_tk(), "fused_linear_cross_entropy", None)):
            return None
        return "op unavailable: twinkle_kernels.fused_linear_cross_entropy does not exist in this build"

    @staticmethod
    def target_reason(cls):
        import inspect
        try:
            params = list(inspect.signature(cls.forward).parameters)
        except (TypeError, ValueError):
            params = []
        if "labels" not in params:
            return f"signature changed: {cls.__qualname__}.forward has no labels parameter"
        if not isinstance(getattr(cls, "loss_function", None), property):
            return f"{cls.__qualname__} has no loss_function property to stand in for"
        return None

    @staticmethod
    def instance_reason(m):
        return _head_reason(getattr(m, "lm_head", None))

    @staticmethod
    def make(orig, backend):
        orig_forward = orig.forward

        def forward(self, *args, **kwargs):
            labels = kwargs.get("labels")
            head = self._modules.get("lm_head")
            if labels is None or not self.training or _head_reason(head) is not None:
                return orig_forward(self, *args, **kwargs)
            return_dict = kwargs.pop("return_dict", None)
            prev_loss = self.__dict__.get("_loss_function", _MISSING)
            self._modules["lm_head"] = _HiddenPassthrough()
            self._loss_function = _causal_lm_loss(head, backend)
            try:
                out = orig_forward(self, *args, return_dict=True, **kwargs)
            finally:
                self._modules["lm_head"] = head
                if prev_loss is _MISSING:
                    del self.__dict__["_loss_function"]
                else:
                    self._loss_function = prev_loss
            out.logits = None
            return out if return_dict is not False else out.to_tuple()

        return forward
