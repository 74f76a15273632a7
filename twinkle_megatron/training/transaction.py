"""A facade call that raises leaves nothing behind: :func:`guard` snapshots what a
``forward_backward`` / ``forward_only`` / ``clip_grad_and_step`` may change and puts it back when
the call raises (the exception is re-raised, never swallowed).

What is kept, per :class:`.engine.TrainState` the call runs (an adapter's, or the base model's):

- the DDP grad buffers of its wrap (``main_grad`` of every trainable parameter is a view into
  them), the parameters' ``.grad`` and ``grad_added_to_main_grad``, and the bucket groups'
  bookkeeping (megatron's first-batch grad counts for ``overlap_grad_reduce``). Gradient
  accumulation over several calls before a step is legitimate, so a failed call must give back
  the grads as they were before *that* call. The first call of a step finds the buffers zero
  (or stale, zero by their mark: ``parallel/main_grads.py``; zeroing them is then exact too):
  the state's bookkeeping says so (no loss count pending and no grads prepared: nothing was
  added since megatron's ``zero_grad_buffer``, or since the wrap was made), and nothing is read
  or copied; a failed call zeroes them again. Only a call that accumulates onto earlier calls'
  grads copies the buffers (on their device: 4 bytes per trainable parameter for fp32 main
  grads, while the call runs; LoRA: the adapter's parameters only). Reading a buffer to find out
  whether it is zero would cost a pass over every gradient on every call (0.09 to 0.2 CPU s per
  170 M parameters);
- the counters: ``pending_tokens`` (the loss count), ``has_grads``, ``grads_ready``,
  ``skip_step``, ``accumulated_calls``, ``cur_step``, ``consumed_train_samples``;
- the training and evaluation meters (loss sums, metric sums, grad norm);
- the LR scheduler's state (``clip_grad_and_step``);
- the RNG: torch's CPU generator, the current CUDA device's, and megatron's RNG tracker states,
  so that dropout draws of a failed call are not drawn.

The router-replay ids are dropped by :meth:`.router_replay.Routing.reset` after every schedule,
failed or not. Nothing here is collective: every rank that raises restores its own state (a
check that fails on one rank is made to fail on every rank before any work starts,
:mod:`twinkle_megatron.validate`).
"""
from __future__ import annotations

import contextlib
import copy
from typing import Iterable, List

import torch

from .engine import Engine, TrainState

_COUNTERS = ("cur_step", "consumed_train_samples", "accumulated_calls", "grads_ready", "skip_step", "has_grads")


class _WrapSnapshot:
    """One DDP-wrapped chunk's grads and bucket bookkeeping."""

    def __init__(self, module, zero: bool):
        """``zero``: the state's grads are known to be zero (see the module docstring)."""
        self.module = module
        buffers = list(getattr(module, "buffers", [])) + list(getattr(module, "expert_parallel_buffers", []))
        # None: the buffer is zero (zeroed again on restore); else a copy of it
        self.buffers = [(b, None if zero else b.grad_data.clone())
                        for b in buffers if getattr(b, "grad_data", None) is not None]
        params = list(getattr(module, "params_with_grad", None) or
                      [p for p in module.parameters() if p.requires_grad])
        # a main_grad outside those buffers (a buffer list this megatron-core version names
        # otherwise): kept on its own, so that every grad the call could add to is covered
        covered = {b.grad_data.untyped_storage().data_ptr() for b, _ in self.buffers}
        self.loose = [(g, None if zero else g.clone()) for g in
                      (getattr(p, "main_grad", None) for p in params)
                      if g is not None and g.untyped_storage().data_ptr() not in covered]
        self.params = [(p, None if p.grad is None else p.grad.clone(),
                        getattr(p, "grad_added_to_main_grad", None)) for p in params]
        groups = list(getattr(module, "bucket_groups", [])) + list(getattr(module, "expert_parallel_bucket_groups", []))
        self.groups = [(g, {k: copy.copy(getattr(g, k)) for k in
                            ("is_first_batch", "per_param_grad_ready_counts", "golden_per_param_grad_ready_counts",
                             "is_last_microbatch") if hasattr(g, k)}) for g in groups]

    def restore(self) -> None:
        for g, fields in self.groups:
            handle = getattr(g, "grad_reduce_handle", None)
            if handle is not None:       # a reduction the failed backward launched: let it land first
                handle.wait()
                g.grad_reduce_handle = None
            for k, v in fields.items():
                setattr(g, k, copy.copy(v))
        for grad, saved in [(b.grad_data, saved) for b, saved in self.buffers] + self.loose:
            if saved is None:
                grad.zero_()
            else:
                grad.copy_(saved)
        for p, grad, added in self.params:
            p.grad = grad
            if added is not None:
                p.grad_added_to_main_grad = added


class Snapshot:
    """What a call of ``states`` may change (see the module docstring); :meth:`restore` puts it
    back. ``grads``: also the grad buffers (not for ``forward_only``); ``scheduler``: also the
    LR scheduler state (``clip_grad_and_step``)."""

    def __init__(self, engine: Engine, states: Iterable[TrainState], *, grads: bool = True,
                 scheduler: bool = False):
        self.states = []
        for s in states:        # TrainState is a (unhashable) dataclass: unique by identity
            if not any(s is t for t in self.states):
                self.states.append(s)
        self.counters = [{k: getattr(s, k) for k in _COUNTERS} for s in self.states]
        self.pending = [None if s.pending_tokens is None else s.pending_tokens.clone() for s in self.states]
        self.meters = [(copy.deepcopy(s.metric), copy.deepcopy(s.eval_metric)) for s in self.states]
        self.schedulers = [s.lr_scheduler.state_dict() if scheduler and s.lr_scheduler is not None else None
                           for s in self.states]
        self.wraps: List[_WrapSnapshot] = []
        if grads:
            for s in self.states:
                zero = s.pending_tokens is None and not s.grads_ready
                self.wraps += [_WrapSnapshot(m, zero) for m in s.model or ()]
        self.rng = _rng_state(engine.device)

    def grads_finalised(self, state: TrainState) -> bool:
        """Whether ``state``'s grads were reduced and scaled since the snapshot (its loss count
        consumed, :func:`.step.finalize_grads`, or prepared for the step): a step got that far."""
        i = next(i for i, s in enumerate(self.states) if s is state)
        return (self.pending[i] is not None and state.pending_tokens is None) or \
            (state.grads_ready and not self.counters[i]["grads_ready"])

    def restore(self, keep_pending: bool = False) -> None:
        """Put everything back; ``keep_pending``: leave the loss counts and grad flags as they are
        now (their grads were dropped, not restored)."""
        for w in self.wraps:
            w.restore()
        for s, counters, pending, (metric, eval_metric), sched in zip(
                self.states, self.counters, self.pending, self.meters, self.schedulers):
            for k, v in counters.items():
                if not (keep_pending and k in ("grads_ready", "skip_step", "has_grads")):
                    setattr(s, k, v)
            if not keep_pending:
                s.pending_tokens = pending
            s.metric, s.eval_metric = metric, eval_metric
            if sched is not None:
                s.lr_scheduler.load_state_dict(sched)
        _set_rng_state(self.rng)


@contextlib.contextmanager
def guard(engine: Engine, states: Iterable[TrainState], *, grads: bool = True, scheduler: bool = False):
    """Run the body as one transaction over ``states``: if it raises, everything a call may
    change (:class:`Snapshot`) is put back and the exception re-raised."""
    snapshot = Snapshot(engine, states, grads=grads, scheduler=scheduler)
    try:
        yield snapshot
    except BaseException:
        snapshot.restore()
        raise


def _rng_state(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = (torch.cuda.get_rng_state(device), device)
    try:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
        tracker = get_cuda_rng_tracker()
        states = tracker.get_states()
        if all(torch.is_tensor(v) for v in states.values()):
            state["tracker"] = (tracker, {k: v.clone() for k, v in states.items()})
    except (ImportError, AttributeError):
        pass
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(*state["cuda"])
    if "tracker" in state:
        tracker, states = state["tracker"]
        tracker.set_states({k: v.clone() for k, v in states.items()})
