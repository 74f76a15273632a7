"""Backend selection for every op.

Each op registers one implementation per backend together with a *verifier*: a
function of the call's arguments that returns ``None`` when the backend can serve
the call, or a short human-readable reason when it cannot. Selection order:

1. the ``backend=`` argument (explicit: a backend that cannot serve raises
   :class:`BackendUnavailableError`);
2. the ``TWINKLE_KERNELS_BACKEND`` environment variable, read on every call
   (a preference: when it cannot serve, the reason is logged once and the
   device default is used);
3. the tensor's device: cuda -> triton, npu -> npu, cpu -> cpu (C++), and
   ``reference`` as the last resort.

A rejected backend logs its reason once per (op, backend, reason).

Each op package registers all its backends the same way (``op(name).register(backend, verify)``);
whether a backend exists in this process is asked of :mod:`._backends` (a leaf), and the verifier
pieces every op shares (device, dtype, forward-only) are in :mod:`._verifiers`.
"""
from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import torch

# The availability probes are a leaf of their own; these names stay importable from here.
from ._backends import BACKENDS, STATUS_CACHE, backend_status, triton_interpret  # noqa: F401

logger = logging.getLogger("twinkle_kernels")

ENV_VAR = "TWINKLE_KERNELS_BACKEND"

Verifier = Callable[..., Optional[str]]


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot serve a call."""


@dataclass
class _Impl:
    fn: Callable
    verify: Optional[Verifier]


@dataclass
class Stages:
    """A backend's forward and backward as separate calls, for the custom ops under torch.compile
    (``<op>/_library.py``, see :mod:`._custom_ops`): ``forward`` takes the op's arguments and returns its outputs followed by the
    statistics the backward needs (the op's own contract, the same for every backend of the op);
    ``backward`` takes the output gradients, the inputs and those statistics."""
    forward: Optional[Callable]   # None: the op saves nothing beyond its inputs (the impl runs as is)
    backward: Callable


@dataclass
class Op:
    name: str
    impls: Dict[str, _Impl] = field(default_factory=dict)
    stages: Dict[str, Stages] = field(default_factory=dict)

    def register(self, backend: str, verify: Optional[Verifier] = None):
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")

        def deco(fn):
            self.impls[backend] = _Impl(fn, verify)
            return fn

        return deco

    def register_stages(self, backend: str, forward: Optional[Callable], backward: Callable) -> None:
        """``backend``'s own forward-with-statistics and backward kernel (see :class:`Stages`);
        backends without them are differentiated by rerunning their forward (:func:`._custom_ops.vjp`)."""
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
        self.stages[backend] = Stages(forward, backward)

    def reason(self, backend: str, *args, **kwargs) -> Optional[str]:
        """Why ``backend`` cannot serve this call, or None when it can."""
        impl = self.impls.get(backend)
        if impl is None:
            return f"no {backend} implementation of {self.name}"
        avail = backend_status(backend)
        if avail is not None:
            return avail
        if impl.verify is not None:
            return impl.verify(*args, **kwargs)
        return None

    def select(self, device: torch.device, backend: Optional[str], *args, **kwargs) -> str:
        if backend is not None and backend != "auto":
            _check_backend_name(backend, "backend")
            why = self.reason(backend, *args, **kwargs)
            if why is not None:
                raise BackendUnavailableError(f"{self.name}: backend {backend!r} cannot serve this call: {why}")
            return backend
        # Hot path (every op call): the environment is still read per call, but the candidate
        # order is a cached tuple per (env value, device type) and the probes are dict lookups.
        env = os.environ.get(ENV_VAR, "")
        key = (env, device.type)
        candidates = _CANDIDATES.get(key)
        if candidates is None:
            candidates = _candidates(env, device)
            _CANDIDATES[key] = candidates
        for name in candidates:
            impl = self.impls.get(name)
            if impl is None:
                why = f"no {name} implementation of {self.name}"
            else:
                why = STATUS_CACHE[name] if name in STATUS_CACHE else backend_status(name)
                if why is None and impl.verify is not None:
                    why = impl.verify(*args, **kwargs)
            if why is None:
                return name
            _log_once(self.name, name, why)
        raise BackendUnavailableError(f"{self.name}: no backend can serve this call")

    def __call__(self, device: torch.device, backend: Optional[str], *args, **kwargs):
        name = self.select(device, backend, *args, **kwargs)
        return self.impls[name].fn(*args, **kwargs)


_OPS: Dict[str, Op] = {}


def lazy(module: str, attr: str) -> Callable:
    """``module.attr``, imported on the first call (a backend's package is never imported before
    it serves a call)."""
    fn = None

    def call(*args, **kwargs):
        nonlocal fn
        if fn is None:
            fn = getattr(importlib.import_module(module), attr)
        return fn(*args, **kwargs)
    call.__name__ = call.__qualname__ = f"{module}.{attr}"
    return call


def op(name: str) -> Op:
    """The registry entry of op ``name`` (created on first use)."""
    if name not in _OPS:
        _OPS[name] = Op(name)
    return _OPS[name]


def registered_ops() -> Dict[str, Op]:
    return dict(_OPS)


def _check_backend_name(name: str, source: str) -> None:
    if name not in BACKENDS:
        raise ValueError(f"{source}={name!r} is not a backend; expected one of {BACKENDS} or 'auto'")


_CANDIDATES: Dict[tuple, tuple] = {}


def _candidates(env: str, device: torch.device) -> tuple:
    """Backends to try, in order, for ``$TWINKLE_KERNELS_BACKEND == env`` on ``device``."""
    env = env.strip().lower()
    first = ()
    if env and env != "auto":
        _check_backend_name(env, ENV_VAR)   # raises: a bad name is never cached
        first = (env,)
    return first + default_order(device)


def default_order(device: torch.device) -> tuple:
    if device.type == "cuda":
        return ("triton", "reference")
    if device.type == "npu":
        return ("npu", "reference")
    if device.type == "cpu":
        return ("cpu", "reference")
    return ("reference",)


def default_backend(device: torch.device) -> str:
    """The backend an op picks on ``device`` when neither the call nor ``$TWINKLE_KERNELS_BACKEND``
    names one: the first of :func:`default_order` usable in this process (an op may still fall
    back further for an input its backend refuses; that is logged once)."""
    return next((b for b in default_order(torch.device(device)) if backend_status(b) is None), "reference")


_LOGGED = set()


def _log_once(op_name: str, backend: str, why: str) -> None:
    key = (op_name, backend, why)
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.info("twinkle_kernels: %s skips backend %r: %s", op_name, backend, why)


def reset() -> None:
    """Forget logged rejections and cached backend probes (tests, after changing the environment)."""
    _LOGGED.clear()
    STATUS_CACHE.clear()
    _CANDIDATES.clear()
