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
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import _dispatch, _verifiers, testing


@dataclass
class Case:
    """One op's self-check: ``make(shape_scale, dtype, device)`` returns the float inputs;
    ``call(*inputs, backend=)`` returns a tensor or a tuple of tensors."""
    op: str
    make: Callable
    call: Callable
    grads: bool = True
    # tolerance widening (scale, atol_scale) of gradient i (over the float inputs that get
    # gradients) given the inputs and its float64 reference; see testing.assert_close. None:
    # scale sqrt(first input's size / gradient's size), for weight-like gradients
    grad_tolerance: Optional[Callable[[Sequence[torch.Tensor], int, torch.Tensor], Tuple[float, float]]] = None


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


def _tk():
    return __import__("twinkle_kernels")


def case(op: str, grads: bool = True, grad_tolerance: Optional[Callable] = None):
    def deco(make_and_call):
        make, call = make_and_call()
        CASES[op] = Case(op, make, call, grads, grad_tolerance)
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
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        if g is None or r is None:
            continue
        grad_err = max(grad_err, testing.max_error(g, r))
        if c.grad_tolerance is not None:
            scale, atol_scale = c.grad_tolerance(inputs, i, r)
        else:  # weight-like gradients sum over all rows: widen by the square root of the row count
            scale, atol_scale = max(1.0, (inputs[0].numel() / max(g.numel(), 1)) ** 0.5), 1.0
        try:
            testing.assert_close(g, r, dtype, op=c.op, name=f"grad {i}", scale=scale, atol_scale=atol_scale)
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
        if b == "triton" and _verifiers.triton_device_reason(torch.empty(0, device=device)):
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
    return make, lambda x, w, backend: _tk().rms_norm(x, w, 1e-6, offset=1.0, backend=backend)


@case("gated_rms_norm")
def _():
    def make(s, dt, dev):
        return [torch.randn(8 * s, 1000, dtype=dt, device=dev), torch.randn(8 * s, 1000, dtype=dt, device=dev),
                torch.randn(1000, dtype=dt, device=dev)]
    return make, lambda x, g, w, backend: _tk().gated_rms_norm(x, g, w, backend=backend)


@case("apply_rotary_pos_emb")
def _():
    def make(s, dt, dev):
        b, sq, hq, hk, d, r = 2, 4 * s, 4, 2, 128, 64  # partial rotary, GQA
        return [torch.randn(b, hq, sq, d, dtype=dt, device=dev), torch.randn(b, hk, sq, d, dtype=dt, device=dev),
                torch.randn(b, sq, r, dtype=dt, device=dev), torch.randn(b, sq, r, dtype=dt, device=dev)]

    def call(q, k, cos, sin, backend):
        return _tk().apply_rotary_pos_emb(q, k, cos.detach(), sin.detach(), 1, backend=backend)
    return make, call


@case("swiglu")
def _():
    def make(s, dt, dev):
        return [torch.randn(8 * s, 1000, dtype=dt, device=dev), torch.randn(8 * s, 1000, dtype=dt, device=dev)]
    return make, lambda g, u, backend: _tk().swiglu(g, u, backend=backend)


@case("swiglu_packed")
def _():
    def make(s, dt, dev):
        return [torch.randn(8 * s, 2000, dtype=dt, device=dev)]
    return make, lambda x, backend: _tk().swiglu_packed(x, backend=backend)


@case("causal_conv1d")
def _():
    def make(s, dt, dev):
        t = 8 * s + 3  # not a multiple of any vector width
        return [torch.randn(1, 32, t, dtype=dt, device=dev), torch.randn(32, 4, dtype=dt, device=dev) / 2,
                torch.randn(32, dtype=dt, device=dev)]
    return make, lambda x, w, b, backend: _tk().causal_conv1d(x, w, b, "silu", backend=backend)


@case("causal_conv1d_update", grads=False)  # a decode step: forward only, conv_state updated in place
def _():
    def make(s, dt, dev):
        return [torch.randn(2, 16 * s, 1, dtype=dt, device=dev), torch.randn(2, 16 * s, 3, dtype=dt, device=dev),
                torch.randn(16 * s, 4, dtype=dt, device=dev) / 2, torch.randn(16 * s, dtype=dt, device=dev)]
    return make, lambda x, state, w, b, backend: _tk().causal_conv1d_update(x, state, w, b, "silu", backend=backend)


@case("chunk_gated_delta_rule", grad_tolerance=lambda inputs, i, ref: (testing.reduction_scale(inputs[0].shape[1]), 1.0))
def _():
    def make(s, dt, dev):
        t = min(4 * s, 256) + 3  # several chunks of 64 and a partial one; the float64 reference loops over t
        q, k = (torch.randn(1, t, 2, 32, dtype=dt, device=dev) for _ in range(2))
        v = torch.randn(1, t, 4, 32, dtype=dt, device=dev)  # 4 value heads on 2 key heads
        g = torch.nn.functional.logsigmoid(torch.randn(1, t, 4, device=dev) + 3).to(dt)
        beta = torch.rand(1, t, 4, device=dev).to(dt)
        return [q, k, v, g, beta]

    def call(q, k, v, g, beta, backend):
        return _tk().chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, backend=backend)[0]
    return make, call


@case("grouped_matmul", grad_tolerance=lambda inputs, i, ref: (testing.reduction_scale(inputs[0].shape[0]) if i == 1 else 1.0, 1.0))
def _():
    def make(s, dt, dev):
        m = 8 * s + 5
        ends = torch.tensor([m // 3, m // 3, m - 7, m], dtype=torch.int32, device=dev)  # an empty group
        return [torch.randn(m, 64, dtype=dt, device=dev), torch.randn(4, 64, 48, dtype=dt, device=dev) / 8, ends]
    return make, lambda x, w, offsets, backend: _tk().grouped_matmul(x, w, offsets, backend=backend)


def _moe_grad_tolerance(inputs, i, ref):
    """Entries of d top_k_weights (dot products over H) and of the expert weight gradients (sums
    over an expert's tokens) are reductions whose low-precision rounding error is proportional
    to the gradient's typical entry, also where an entry cancels to about 0: the absolute
    tolerance follows twice the rms (as the benchmark gate does). Measured in bf16 at the CPU
    shape: d gate_up_proj rms 4.0, max error 0.18 (eager bf16: 0.10)."""
    idx = inputs[1]
    rms = testing.rms_atol_scale(ref)
    if i == 1:
        return 1.0, rms
    if i in (2, 3):
        return testing.reduction_scale(int(torch.bincount(idx.reshape(-1).cpu()).max())), rms
    return 1.0, 1.0


@case("moe_experts", grad_tolerance=_moe_grad_tolerance)
def _():
    def make(s, dt, dev):
        t, e, k, h, i = 4 * s + 1, 8, 2, 64, 32
        gen = torch.Generator().manual_seed(0)
        idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(dev)
        return [torch.randn(t, h, dtype=dt, device=dev), idx, torch.softmax(torch.randn(t, k, device=dev), -1).to(dt),
                (torch.randn(e, 2 * i, h, device=dev) / h ** 0.5).to(dt),
                (torch.randn(e, h, i, device=dev) / i ** 0.5).to(dt)]
    return make, lambda hs, idx, wts, gu, dp, backend: _tk().moe_experts(hs, idx, wts, gu, dp, backend=backend)

