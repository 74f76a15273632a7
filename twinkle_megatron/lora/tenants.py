"""Several named adapters on one base model, trained time-shared: each call of the facade runs
one adapter (or the bare base model), and everything that training changes lives in that
adapter's own train state (:class:`twinkle_megatron.training.engine.TrainState`, owned by the
training engine). A mixed call (:mod:`.mixed`) makes several adapters trainable at once; each
one's grads still land in its own wrap's buffer.

Which adapter runs is switched, not copied: :func:`activate` turns the forward hook of every
other adapter off (:attr:`LoraAdapter.enabled`) and sets ``requires_grad`` on the running
adapter's parameters only. The second half matters beyond saving work: megatron's DDP lays out
its grad buffer from the parameters that require grad when it wraps, and its
``finalize_model_grads`` all-reduces the sequence-parallel grads of every parameter that requires
grad; so each adapter gets its own DDP wrap (made while it is the only trainable one, so an
adapter added after the others were wrapped is reduced over DP like them), and finalising one
adapter never touches another's accumulated grads.
"""
from __future__ import annotations

from typing import Dict, Optional


def activate(adapters: Dict[str, object], name: Optional[str]) -> None:
    """Run adapter ``name`` only (None: no adapter): its deltas on and its parameters trainable,
    every other adapter's deltas off and parameters frozen."""
    for adapter in adapters.values():
        on = adapter.name == name
        switch(adapter, enabled=on, trainable=on)


def rest(adapters: Dict[str, object]) -> None:
    """The state between calls: a lone adapter is on (the model then behaves as with one
    adapter everywhere); with several, none is (a direct call on the chunks runs the base model).
    Every adapter's parameters require grad (they are all trainable, each in its own calls)."""
    lone = len(adapters) == 1
    for adapter in adapters.values():
        switch(adapter, enabled=lone, trainable=True)


def switch(adapter, *, enabled: bool, trainable: bool) -> None:
    """Turn ``adapter``'s forward hooks on or off and its parameters trainable or frozen (bools). Its
    parameter list is kept on it (walking its modules for them on every call of every adapter
    was a third of a small model's step)."""
    params = adapter.__dict__.get("_params")
    if params is None:
        params = adapter._params = [p for m in adapter.modules for p in m.parameters()]
    # only what changes is written: most calls find most adapters as they were, and a module's
    # __setattr__ and requires_grad_ cost more than reading the flags
    for module in adapter.modules:
        if module.__dict__.get("enabled") != enabled:
            module.enabled = enabled
    for p in params:
        if p.requires_grad != trainable:
            p.requires_grad_(trainable)
