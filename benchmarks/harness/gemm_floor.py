"""A step's matrix products, recorded and replayed alone: the floor under any implementation that
does the same products in the same dtypes with the same library.

A training step of a dense transformer is mostly GEMMs. Two implementations of one model do the
same products (the same weights times the same activations, forward and backward), so when both
call one GEMM library in the same dtypes, the faster can be at most ``step / gemm_seconds`` times
faster than the slower, where ``gemm_seconds`` is the time those products take run one after
another on nothing else. :func:`record` collects every matrix product one step dispatches (ATen's ``mm``, ``addmm``,
``bmm``, ``baddbmm``, ``addbmm`` and ``_grouped_mm``, forward and backward, after autocast's casts:
the dtypes the library really ran); :func:`replay` times each distinct product on fresh random
operands of the same shapes, strides and dtypes, and multiplies by how often the step ran it.

The floor is a lower bound on purpose: the replay runs each product with its operands warm in
cache and leaves out attention's own kernels, the gated delta rule's products inside its op, and
every elementwise pass. A floor that leaves a ratio out of reach therefore leaves it out of reach.
"""
from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from . import timing

#: the ATen matrix products a step's linear layers, attention projections and experts reach
GEMM_OPS = ("mm", "addmm", "bmm", "baddbmm", "addbmm", "_grouped_mm")


class _Spec:
    """A tensor argument as the replay rebuilds it: shape, strides and dtype for floating
    operands (their values do not change a GEMM's time); the values themselves for integer ones
    (``_grouped_mm``'s group offsets decide its work)."""

    __slots__ = ("shape", "stride", "dtype", "value")

    def __init__(self, t: torch.Tensor):
        self.shape, self.stride, self.dtype = tuple(t.shape), tuple(t.stride()), t.dtype
        self.value = None if t.is_floating_point() else t.detach().clone()

    def key(self):
        v = None if self.value is None else tuple(self.value.flatten().tolist())
        return ("T", self.shape, self.stride, str(self.dtype), v)

    def build(self, device):
        if self.value is not None:
            return self.value.to(device)
        # the storage filled, then viewed: an expanded operand (stride 0, a broadcast bias) stays one
        size = 1 + sum((n - 1) * st for n, st in zip(self.shape, self.stride)) if all(self.shape) else 0
        base = torch.empty(size, dtype=self.dtype, device=device)
        if size:
            base.normal_()
        return base.as_strided(self.shape, self.stride)


def _spec(x):
    if isinstance(x, torch.Tensor):
        return _Spec(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_spec(v) for v in x)
    return x


def _key(x):
    if isinstance(x, _Spec):
        return x.key()
    if isinstance(x, (list, tuple)):
        return tuple(_key(v) for v in x)
    return x


def _build(x, device):
    if isinstance(x, _Spec):
        return x.build(device)
    if isinstance(x, (list, tuple)):
        return type(x)(_build(v, device) for v in x)
    return x


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = collections.OrderedDict()   # key -> [op, args, kwargs, count]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket.__name__ in GEMM_OPS:
            a, k = _spec(args), {n: _spec(v) for n, v in kwargs.items()}
            key = (str(func), _key(a), tuple(sorted((n, _key(v)) for n, v in k.items())))
            entry = self.calls.setdefault(key, [func, a, k, 0])
            entry[3] += 1
        return func(*args, **kwargs)


class Recording:
    """The distinct matrix products of a recorded region: ``calls`` maps a key to
    ``[aten op, argument specs, keyword specs, count]``."""

    def __init__(self, calls):
        self.calls = calls

    @property
    def count(self) -> int:
        return sum(c[3] for c in self.calls.values())


def record(fn):
    """Run ``fn()`` (one training step: forward, backward, optimizer) and return ``(its result,
    a Recording of the matrix products it dispatched)``."""
    mode = _Recorder()
    with mode:
        out = fn()
    return out, Recording(mode.calls)


def _grouped_flops(func, args, kwargs):
    """``_grouped_mm``'s FLOPs (torch's counter has no formula for it): 2 per multiply-add over the
    rows its offsets cover. Forms: ``[M, K] x [G, K, N]`` (the ragged M), ``[K, M] x [M, N]`` (a
    weight gradient, the ragged M), ``[G, M, K] x [G, K, N]``; 0 for any other op."""
    if func.overloadpacket.__name__ != "_grouped_mm":
        return 0
    a, b = args[0], args[1]
    offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
    last = int(offs[-1]) if isinstance(offs, torch.Tensor) and offs.numel() else None
    if a.dim() == 2 and b.dim() == 3:
        m = a.shape[0] if last is None else min(a.shape[0], last)
        return 2 * m * a.shape[1] * b.shape[2]
    if a.dim() == 2 and b.dim() == 2:
        m = a.shape[1] if last is None else min(a.shape[1], last)
        return 2 * a.shape[0] * m * b.shape[1]
    if a.dim() == 3 and b.dim() == 3:
        return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
    return 0


def replay(recording: Recording, device: str = "cpu", reps: int = 3) -> dict:
    """Time every distinct product of ``recording`` alone (:func:`.timing.time_fn`, median of
    ``reps`` after one warm-up; process CPU seconds on CPU, CUDA events on CUDA) and sum, each
    times its count.

    Returns ``{'seconds', 'flops', 'calls', 'distinct', 'rows'}``; ``rows`` are ``[op, shapes,
    dtype, count, seconds per call, FLOPs per call]``, most time first. FLOPs are torch's
    ``FlopCounterMode`` count, ``_grouped_mm``'s counted here."""
    rows, total_s, total_f = [], 0.0, 0
    for func, args, kwargs, count in recording.calls.values():
        a, k = _build(args, device), {n: _build(v, device) for n, v in kwargs.items()}
        flops_mode = FlopCounterMode(display=False)
        with flops_mode:
            func(*a, **k)
        flops = flops_mode.get_total_flops() or _grouped_flops(func, a, k)
        # the harness's one timing loop: one warm-up (the library picks its kernel for the shape)
        t = timing.time_fn(lambda: func(*a, **k), torch.device(device), warmup=1, min_reps=reps,
                           max_reps=reps, budget_s=0.0)
        s = (t.cpu if t.cpu is not None else t).median_ms / 1e3
        shapes = [list(x.shape) for x in a if isinstance(x, torch.Tensor)]
        dtype = next((str(x.dtype).replace("torch.", "") for x in a
                      if isinstance(x, torch.Tensor) and x.is_floating_point()), "")
        rows.append([func.overloadpacket.__name__, shapes, dtype, count, s, flops])
        total_s += s * count
        total_f += flops * count
        del a, k
    rows.sort(key=lambda r: r[3] * r[4], reverse=True)
    return {"seconds": total_s, "flops": total_f, "calls": recording.count, "distinct": len(rows), "rows": rows}
