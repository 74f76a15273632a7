"""The self-check behind ``python -m twinkle_kernels``.

For every registered op and every backend that can run here, it compares forward and
gradients against the float64 reference on a moderate shape, and times the op against
eager torch (the reference in the input dtype). Triton runs in the interpreter on CPU
(``TRITON_INTERPRET=1``, set by ``__main__`` before Triton is imported) at a small shape.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch

from . import _dispatch, testing


@dataclass
class Case:
    """One op's self-check: ``make(shape_scale, dtype, device)`` returns the float inputs;
    ``call(*inputs, backend=)`` returns a tensor or a tuple of tensors."""
    op: str
    make: Callable
    call: Callable
    grads: bool = True


@dataclass
class Result:
    op: str
    backend: str
    dtype: str
    ok: bool
    fwd_err: float
    grad_err: float
    ms: Optional[float]
    eager_ms: Optional[float]
    note: str = ""


CASES: Dict[str, Case] = {}


def case(op: str, grads: bool = True):
    def deco(make_and_call):
        make, call = make_and_call()
        CASES[op] = Case(op, make, call, grads)
        return make_and_call
    return deco


def _outs(o) -> List[torch.Tensor]:
    return [t for t in (o if isinstance(o, (tuple, list)) else (o,)) if isinstance(t, torch.Tensor)]


def _run(c: Case, inputs: Sequence[torch.Tensor], backend: str):
    xs = [t.detach().clone().requires_grad_(c.grads and t.is_floating_point()) for t in inputs]
    outs = _outs(c.call(*xs, backend=backend))
    grads = []
    if c.grads:
        torch.manual_seed(1)
        seeds = [torch.randn_like(o, dtype=torch.float64) for o in outs]
        loss = sum((o.double() * s).sum() for o, s in zip(outs, seeds))
        leaves = [x for x in xs if x.requires_grad]
        grads = list(torch.autograd.grad(loss, leaves, allow_unused=True))
    return [o.detach() for o in outs], grads


def _time(fn, reps: int) -> float:
    fn()  # warm-up (and Triton compilation)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def check(c: Case, backend: str, dtype: torch.dtype, device: torch.device, scale: int, reps: int) -> Result:
    torch.manual_seed(0)
    inputs = c.make(scale, dtype, device)
    try:
        outs, grads = _run(c, inputs, backend)
    except Exception as e:  # reported as a failed check, never swallowed silently
        return Result(c.op, backend, str(dtype).replace("torch.", ""), False, float("nan"), float("nan"),
                      None, None, f"{type(e).__name__}: {e}")
    ref_outs, ref_grads = _run(c, [t.double() if t.is_floating_point() else t for t in inputs], "reference")
    ok, fwd_err, grad_err, note = True, 0.0, 0.0, ""
    for o, r in zip(outs, ref_outs):
        fwd_err = max(fwd_err, testing.max_error(o, r))
        try:
            testing.assert_close(o, r, dtype, op=c.op, name="output")
        except AssertionError as e:
            ok, note = False, str(e).splitlines()[0]
    for g, r in zip(grads, ref_grads):
        if g is None or r is None:
            continue
        grad_err = max(grad_err, testing.max_error(g, r))
        try:
            # Weight-like gradients sum over all rows: widen by the square root of the row count.
            testing.assert_close(g, r, dtype, op=c.op, name="grad", scale=max(1.0, (inputs[0].numel() / max(
                g.numel(), 1)) ** 0.5))
        except AssertionError as e:
            ok, note = False, str(e).splitlines()[0]
    ms = eager = None
    if reps:
        xs = [t.detach() for t in inputs]
        with torch.no_grad():
            ms = _time(lambda: c.call(*xs, backend=backend), reps)
            eager = _time(lambda: c.call(*xs, backend="reference"), reps)
    return Result(c.op, backend, str(dtype).replace("torch.", ""), ok, fwd_err, grad_err, ms, eager, note)


def runnable_backends(device: torch.device) -> List[str]:
    out = []
    for b in _dispatch.BACKENDS:
        if b == "reference":
            continue
        if _dispatch.backend_status(b) is not None:
            continue
        if b == "triton" and _dispatch.triton_device_reason(torch.empty(0, device=device)):
            continue
        if b == "cpu" and device.type != "cpu":
            continue
        if b == "npu" and device.type != "npu":
            continue
        out.append(b)
    return out


# --- the cases -------------------------------------------------------------------------------
# scale: rows for the moderate CPU shape; Triton in the interpreter uses scale=1 (tiny).

@case("rms_norm")
def _():
    def make(s, dt, dev):
        return [torch.randn(8 * s, 1000, dtype=dt, device=dev), torch.randn(1000, dtype=dt, device=dev)]
    return make, lambda x, w, backend: __import__("twinkle_kernels").rms_norm(x, w, 1e-6, offset=1.0,
                                                                             backend=backend)


@case("gated_rms_norm")
def _():
    def make(s, dt, dev):
        return [torch.randn(8 * s, 1000, dtype=dt, device=dev), torch.randn(8 * s, 1000, dtype=dt, device=dev),
                torch.randn(1000, dtype=dt, device=dev)]
    return make, lambda x, g, w, backend: __import__("twinkle_kernels").gated_rms_norm(x, g, w, backend=backend)


@case("apply_rotary_pos_emb")
def _():
    def make(s, dt, dev):
        b, sq, hq, hk, d, r = 2, 4 * s, 4, 2, 128, 64  # partial rotary, GQA
        return [torch.randn(b, hq, sq, d, dtype=dt, device=dev), torch.randn(b, hk, sq, d, dtype=dt, device=dev),
                torch.randn(b, sq, r, dtype=dt, device=dev), torch.randn(b, sq, r, dtype=dt, device=dev)]

    def call(q, k, cos, sin, backend):
        return __import__("twinkle_kernels").apply_rotary_pos_emb(q, k, cos.detach(), sin.detach(), 1,
                                                                  backend=backend)
    return make, call


@case("swiglu")
def _():
    def make(s, dt, dev):
        return [torch.randn(8 * s, 1000, dtype=dt, device=dev), torch.randn(8 * s, 1000, dtype=dt, device=dev)]
    return make, lambda g, u, backend: __import__("twinkle_kernels").swiglu(g, u, backend=backend)


@case("swiglu_packed")
def _():
    def make(s, dt, dev):
        return [torch.randn(8 * s, 2000, dtype=dt, device=dev)]
    return make, lambda x, backend: __import__("twinkle_kernels").swiglu_packed(x, backend=backend)
