"""Stale ``main_grad`` buffers: the step's first write overwrites instead of adding.

megatron's DDP accumulates every weight gradient into an fp32 ``main_grad`` (a view into its grad
buffer) and zeroes the buffers once per step. On the CPU the one-pass optimizer step
(``training/fused_adam.py``) reads each grad once; zeroing it there, and reading those zeros back
in the next backward's first accumulation, are two passes over 4 bytes per parameter that change
nothing. Transformer Engine's ``overwrite_main_grad`` makes the same trade for megatron's FSDP.

The protocol, per ``main_grad`` tensor:

- :func:`mark` (the optimizer step, after reading the grads): the contents are stale, their value
  is zero. Under ``twinkle_kernels.testing.poison_outputs`` the buffer is also filled with NaN, so
  that a writer that adds without asking (:func:`claim`) shows up as NaN gradients in the tests.
- :func:`claim` (every writer, before writing): True the first time after :func:`mark`; the writer
  then overwrites (``wgrad_accum(..., accumulate=False)``, ``copy_``, or ``zero_`` then its add)
  and the buffer is fresh again. False: add as usual.
- :func:`settle` (after the backward passes of a ``forward_backward``, before anything reads the
  grads): a buffer nobody wrote in them (an expert that got no tokens, a layer the loss did not
  reach) is zeroed.

The writers that claim are the CPU ones of ``cpu_compat``: the linear layers' fused weight
gradient (item 14, which the routed experts' products call too), DDP's backward hook (item 12,
every gradient that reaches ``param.grad``) and the word embedding's rows (item 13).
``cpu_compat.claims_stale_main_grads()`` says when they are all in place; otherwise nothing is
marked and the step zeroes the grads as before.
"""
from __future__ import annotations

from typing import Iterable

import torch

_ATTR = "_twinkle_stale_main_grad"


def mark(grads: Iterable[torch.Tensor]) -> None:
    """Mark ``grads`` (``main_grad`` tensors the optimizer step has read) stale."""
    from twinkle_kernels import testing
    poison = testing.poisoning()
    for g in grads:
        setattr(g, _ATTR, True)
        if poison:
            g.fill_(float("nan"))


def claim(grad: torch.Tensor) -> bool:
    """Whether ``grad`` is stale; if so it is fresh from now on, and the caller must overwrite it
    whole (its contents are not zero)."""
    if getattr(grad, _ATTR, False):
        setattr(grad, _ATTR, False)
        return True
    return False


def is_stale(grad: torch.Tensor) -> bool:
    return bool(getattr(grad, _ATTR, False))


def settle(params: Iterable[torch.nn.Parameter]) -> int:
    """Zero the stale ``main_grad`` of ``params`` (none was written since the step); returns how
    many were."""
    n = 0
    for p in params:
        g = getattr(p, "main_grad", None)
        if g is not None and claim(g):
            g.zero_()
            n += 1
    return n
