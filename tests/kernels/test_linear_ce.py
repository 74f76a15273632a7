"""fused_linear_cross_entropy against the float64 unfused reference (torch's cross entropy on
the whole logits), on every fast backend available here (the C++ cpu backend; Triton in the
interpreter, fp32; the chunked torch engine the NPU backend runs)."""
import math

import pytest
import torch
import torch.nn.functional as F

import twinkle_kernels as tk
from twinkle_kernels import testing
from twinkle_kernels.linear_ce import _chunked, fused_linear_cross_entropy_reference as ref_fn

from conftest import cpu_backend_available, triton_available

FAST = []
if cpu_backend_available():
    FAST.append("cpu")
if triton_available():
    FAST.append("triton")
# Triton runs on the GPU when there is one, else on CPU tensors in the interpreter (conftest).
TRITON_DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _dev(backend):
    return TRITON_DEV if backend == "triton" else "cpu"


def _needs_cpu_tensors(backend):
    if _dev(backend) != "cpu":
        pytest.skip("checked on CPU tensors; the GPU runs the fp64-reference cases")


def _inputs(N=37, H=24, V=75, dtype=torch.float32, ignore=(3, 10, 11), bias=False, scale=1.0):
    h = torch.randn(N, H, dtype=torch.float64) * scale
    w = torch.randn(V, H, dtype=torch.float64) / math.sqrt(H) * 2
    b = torch.randn(V, dtype=torch.float64) * 0.5 if bias else None
    y = torch.randint(0, V, (N,))
    for i in ignore:
        if i < N:
            y[i] = -100
    return h.to(dtype), w.to(dtype), (None if b is None else b.to(dtype)), y


def _run(fn, h, w, b, y, kw, coefs):
    """Outputs and gradients of sum(coef * output) over the returned outputs."""
    h = h.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    b = None if b is None else b.detach().clone().requires_grad_(True)
    out = fn(h, w, y, bias=b, **kw)
    outs = out if isinstance(out, tuple) else (out,)
    total = sum((o.double() * c).sum() for o, c in zip(outs, coefs))
    total.backward()
    grads = (h.grad, w.grad, None if b is None else b.grad)
    return [o.detach() for o in outs], grads


def _check(backend, h, w, b, y, kw, dtype=torch.float32, chunk=16):
    n_out = 1 + bool(kw.get("return_logps")) + bool(kw.get("return_entropy"))
    shape = y.shape if kw.get("reduction", "mean") == "none" else ()
    coefs = [torch.randn(shape if i == 0 else y.shape, dtype=torch.float64) for i in range(n_out)]
    exp_out, exp_g = _run(ref_fn, h.double(), w.double(), None if b is None else b.double(), y, kw, coefs)
    dev = _dev(backend)
    to = lambda t: None if t is None else t.to(dev)  # noqa: E731
    got_out, got_g = _run(lambda *a, **k: tk.fused_linear_cross_entropy(*a, backend=backend, chunk_size=chunk, **k),
                          to(h), to(w), to(b), to(y), kw, [c.to(dev) for c in coefs])
    got_out = [t.cpu() for t in got_out]
    got_g = [None if t is None else t.cpu() for t in got_g]
    for i, (g, e) in enumerate(zip(got_out, exp_out)):
        assert g.dtype == torch.float32
        testing.assert_close(g, e, dtype, name=f"output {i}", scale=testing.reduction_scale(h.shape[1]))
    N, V = h.shape[0], w.shape[0]
    for name, g, e, n in zip(("d hidden", "d weight", "d bias"), got_g, exp_g, (V, N, N)):
        if e is None:
            continue
        assert g.dtype == dtype
        testing.assert_close(g, e, dtype, name=name, scale=testing.reduction_scale(n))
    return got_out, exp_out


CASES = [
    dict(),
    dict(reduction="sum"),
    dict(reduction="none"),
    dict(label_smoothing=0.1),
    dict(reduction="none", label_smoothing=0.25, return_logps=True, return_entropy=True),
    dict(logit_softcap=3.0),
    dict(temperature=0.7, return_logps=True),
    dict(temperature=1.7, logit_softcap=2.5, return_entropy=True),
    dict(reduction="sum", label_smoothing=0.3, logit_softcap=4.0, temperature=0.5, return_logps=True,
         return_entropy=True),
]

TRITON_SKIP = (1, 3, 5, 6)


@pytest.mark.parametrize("backend", FAST + ["npu-engine"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_fp64_reference(backend, case, monkeypatch):
    if backend == "npu-engine":
        # The NPU backend's chunked torch engine, run here on CPU tensors through the cpu slot.
        from twinkle_kernels.linear_ce import _cpu
        monkeypatch.setattr(_cpu, "ENGINE", _chunked.TORCH_ENGINE)
        backend = "cpu"
        if not cpu_backend_available():
            pytest.skip("the cpu slot is unavailable")
    if backend == "triton" and case in TRITON_SKIP:
        pytest.skip("interpreter time: the triton rows are covered by the other cases")
    h, w, b, y = _inputs(bias=case % 2 == 1)
    _check(backend, h, w, b, y, CASES[case])


@pytest.mark.parametrize("backend", FAST)
def test_chunking_shapes(backend):
    # N not a multiple of the chunk, one-token chunks, V = 1, V not a multiple of 8, one row.
    for N, V, chunk in ((37, 75, 5), (9, 1, 4), (1, 13, 8), (10, 1031, 4)):
        h, w, b, y = _inputs(N=N, V=V, ignore=(2,))
        _check(backend, h, w, b, y, dict(return_logps=True), chunk=chunk)


@pytest.mark.parametrize("backend", FAST + ["reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_ignored(backend, dtype):
    # The contract: per-token losses (``none``) and ``sum`` are 0; ``mean`` is torch's 0 / 0 = NaN, and
    # the gradients are zeros, as torch's own (checked here against F.cross_entropy itself).
    _needs_cpu_tensors(backend)
    if backend == "triton" and dtype != torch.float32:
        pytest.skip("bf16 math is wrong in the Triton interpreter")
    h, w, _, y = _inputs(N=6, ignore=range(6))
    h, w = h.to(dtype), w.to(dtype)
    for kw in (dict(), dict(label_smoothing=0.2), dict(return_logps=True)):
        hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        out = tk.fused_linear_cross_entropy(hh, ww, y, backend=backend, **kw)
        loss = out[0] if isinstance(out, tuple) else out
        th, tw = h.float().clone().requires_grad_(True), w.float().clone().requires_grad_(True)
        expect = F.cross_entropy(th @ tw.T, y, label_smoothing=kw.get("label_smoothing", 0.0))
        assert torch.isnan(loss) and torch.isnan(expect)      # torch: NaN (0 / 0)
        loss.backward()
        expect.backward()
        assert torch.equal(th.grad, torch.zeros_like(th)) and torch.equal(tw.grad, torch.zeros_like(tw))
        assert torch.equal(hh.grad, torch.zeros_like(hh)) and torch.equal(ww.grad, torch.zeros_like(ww))
    s = tk.fused_linear_cross_entropy(h, w, y, reduction="sum", backend=backend)
    assert s.item() == 0.0
    loss, lp, ent = tk.fused_linear_cross_entropy(h, w, y, reduction="none", return_logps=True,
                                                  return_entropy=True, backend=backend)
    assert all(torch.equal(t, torch.zeros(6)) for t in (loss, lp, ent))


@pytest.mark.parametrize("backend", FAST)
def test_unused_entropy_has_no_gradient(backend):
    _needs_cpu_tensors(backend)
    # Entropy returned but not used: the gradient is the loss's alone (the other mode's path).
    h, w, _, y = _inputs()
    hh = h.clone().requires_grad_(True)
    loss, _ent = tk.fused_linear_cross_entropy(hh, w, y, return_entropy=True, backend=backend, chunk_size=8)
    loss.backward()
    h2 = h.double().requires_grad_(True)
    F.cross_entropy(h2 @ w.double().T, y).backward()
    testing.assert_close(hh.grad, h2.grad, torch.float32, name="d hidden")


def test_leading_dims_and_noncontiguous():
    h, w, _, y = _inputs(N=24)
    h3 = h.view(2, 12, -1).transpose(0, 1)          # [12, 2, H], not contiguous
    y3 = y.view(2, 12).T
    out = tk.fused_linear_cross_entropy(h3, w, y3, reduction="none", return_logps=True)
    exp = ref_fn(h3.double(), w.double(), y3, reduction="none", return_logps=True)
    assert out[0].shape == (12, 2) and out[1].shape == (12, 2)
    for g, e in zip(out, exp):
        testing.assert_close(g, e, torch.float32)


@pytest.mark.skipif(not cpu_backend_available(), reason="C++ extension not built")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_cpu(dtype):
    h, w, b, y = _inputs(N=40, H=64, V=300, bias=True)
    _check("cpu", h.to(dtype), w.to(dtype), b.to(dtype), y, dict(return_logps=True, label_smoothing=0.1), dtype=dtype)
    _check("cpu", h.to(dtype), w.to(dtype), None, y, dict(), dtype=dtype)  # the loss-only mode


@pytest.mark.skipif(not cpu_backend_available(), reason="C++ extension not built")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab_block,chunk", [(64, 64), (37, 16), (1, 40)])
def test_reduced_precision_vocab_blocks(dtype, vocab_block, chunk, monkeypatch):
    # The bf16 / fp16 path goes vocabulary-outer: several blocks (one of them partial) with all tokens
    # in one chunk (the weight gradient from one GEMM per block) and in several chunks (fp32 block
    # accumulator); one-row blocks merge the online softmax over every vocabulary row.
    from twinkle_kernels.linear_ce import _cpu
    monkeypatch.setattr(_cpu.ENGINE, "vocab_block", vocab_block)
    h, w, b, y = _inputs(N=40, H=32, V=150, bias=True)
    kw = dict(reduction="none", return_logps=True, return_entropy=True, label_smoothing=0.2, logit_softcap=3.0)
    _check("cpu", h.to(dtype), w.to(dtype), b.to(dtype), y, kw, dtype=dtype, chunk=chunk)
    _check("cpu", h.to(dtype), w.to(dtype), None, y, dict(temperature=0.8), dtype=dtype, chunk=chunk)


def _products(fn):
    """fn() run under the profiler: how many matrix products (ATen mm / addmm, the C++ kernels'
    own calls included) it made."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.name in ("aten::mm", "aten::addmm", "aten::addmm_") for e in prof.events())


@pytest.mark.skipif(not cpu_backend_available(), reason="C++ extension not built")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("N,H,vocab_block,recomputed,recomputed_frozen", [
    (12, 40, 16, 0, 0),    # 10 blocks: 9 parked in the weight gradient, the last one spilled
    (40, 16, 32, 4, 3),    # N > H: 5 blocks, one parked (frozen: two), the rest more than a spill holds
    (40, 16, 7, 14, 13),   # 22 blocks, 8 parked (frozen: 9), a partial one at the end
    (9, 24, 150, 0, 0),    # one block covering the whole vocabulary, spilled (frozen: parked)
])
def test_reduced_precision_parked_blocks(dtype, N, H, vocab_block, recomputed, recomputed_frozen, monkeypatch):
    # The loss-only mode with all tokens in one chunk parks pass 1's logits blocks in the weight
    # gradient's storage (NaN-poisoned by conftest) and reads them back in pass 2: every block when
    # N <= H (the last ones, with no weight gradient rows left past them, in a spill of at most two
    # blocks), some of them when N > H (the rest recomputed). Three products per block (logits, dh,
    # dW), one more per recomputed block. A frozen weight has no dW product and no weight gradient:
    # its blocks are packed into a scratch of min(N, H) * V entries, with no rows to keep clear.
    from twinkle_kernels.linear_ce import _cpu
    monkeypatch.setattr(_cpu.ENGINE, "vocab_block", vocab_block)
    h, w, b, y = _inputs(N=N, H=H, V=150, bias=True)
    for kw, bias in ((dict(), None), (dict(reduction="sum", label_smoothing=0.2, logit_softcap=3.0), b),
                     (dict(temperature=0.8), b)):
        _check("cpu", h.to(dtype), w.to(dtype), None if bias is None else bias.to(dtype), y, kw, dtype=dtype,
               chunk=N)
    h, w = h.to(dtype), w.to(dtype)
    blocks = -(-150 // vocab_block)
    hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    assert _products(lambda: tk.fused_linear_cross_entropy(hh, ww, y, backend="cpu", chunk_size=N)) == \
        3 * blocks + recomputed
    hh, out = h.clone().requires_grad_(True), []
    assert _products(lambda: out.append(tk.fused_linear_cross_entropy(hh, w, y, backend="cpu", chunk_size=N))) == \
        2 * blocks + recomputed_frozen
    out[0].backward()    # the loss-only mode: its products were all in the forward
    exp_h = h.double().requires_grad_(True)
    F.cross_entropy(exp_h @ w.double().T, y).backward()
    testing.assert_close(hh.grad, exp_h.grad, dtype, name="d hidden (frozen weight)",
                         scale=testing.reduction_scale(N))


@pytest.mark.skipif(not cpu_backend_available(), reason="C++ extension not built")
@pytest.mark.parametrize("N,H,vocab_block,chunk,products", [
    (12, 40, 16, None, 30),   # 10 blocks: 9 parked in the weight gradient, the last one spilled
    (9, 24, 7, None, 66),     # 22 blocks, a partial one at the end
    (12, 40, 0, None, 3),     # one block covering the vocabulary, spilled
    (12, 40, 16, 12, 30),     # the one chunk asked for
    (40, 16, 32, None, 3),    # N > H: the blocks do not all park, token-outer in one chunk
    (12, 40, 16, 5, 9),       # chunks asked for: token-outer, 3 chunks
])
def test_fp32_loss_only_goes_vocabulary_outer_when_every_block_parks(N, H, vocab_block, chunk, products,
                                                                       monkeypatch):
    # fp32's loss-only mode goes vocabulary-outer (three products per block, none recomputed) when
    # every block of logits parks in the weight gradient (handed over unzeroed: NaN-poisoned by
    # conftest) or in the spill; otherwise token-outer (three products per chunk). Both write the
    # whole weight gradient; the gradients are the float64 reference's either way.
    from twinkle_kernels.linear_ce import _cpu
    monkeypatch.setattr(_cpu.ENGINE, "vocab_block", vocab_block)
    h, w, b, y = _inputs(N=N, H=H, V=150, bias=True)
    for kw, bias in ((dict(), None), (dict(reduction="sum", label_smoothing=0.2, logit_softcap=3.0), b),
                     (dict(temperature=0.8), b)):
        _check("cpu", h, w, bias, y, kw, chunk=chunk)
    hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    assert _products(lambda: tk.fused_linear_cross_entropy(hh, ww, y, backend="cpu", chunk_size=chunk)) == products
    # a frozen weight (no weight gradient to park in): token-outer, two products per chunk
    hh = h.clone().requires_grad_(True)
    chunks = -(-N // (chunk or N))
    assert _products(lambda: tk.fused_linear_cross_entropy(hh, w, y, backend="cpu", chunk_size=chunk)) == 2 * chunks


@pytest.mark.skipif(not cpu_backend_available(), reason="C++ extension not built")
def test_bf16_weight_grad_has_no_fp32_copy():
    # The bf16 path writes the weight gradient in bf16 block by block: the only [V, H] buffer made on
    # the Python side is the bf16 gradient itself (no fp32 accumulator, no fp32 copy when scaling);
    # the C++ side's scratch is a [C, Vb] block (peak memory: benchmarks/scripts/linear_ce_cpu.py).
    h, w, _, y = _inputs(N=16, H=64, V=4096)
    h, w = h.bfloat16().requires_grad_(True), w.bfloat16().requires_grad_(True)
    big = []
    real_empty, real_zeros = torch.empty, torch.zeros

    def spy(real):
        def f(*shape, **kw):
            t = real(*shape, **kw)
            if t.numel() >= w.numel():
                big.append(t.dtype)
            return t
        return f
    from unittest import mock
    with mock.patch.object(torch, "empty", spy(real_empty)), mock.patch.object(torch, "zeros", spy(real_zeros)):
        loss = tk.fused_linear_cross_entropy(h, w, y, backend="cpu")
        (loss * 3).backward()
    assert big == [torch.bfloat16], big
    exp_w = w.detach().double().requires_grad_(True)
    (F.cross_entropy(h.detach().double() @ exp_w.T, y) * 3).backward()
    testing.assert_close(w.grad, exp_w.grad, torch.bfloat16, name="d weight", scale=testing.reduction_scale(16))


def test_float64_runs_on_reference():
    h, w, _, y = _inputs(dtype=torch.float64)
    out = tk.fused_linear_cross_entropy(h, w, y)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, F.cross_entropy(h @ w.T, y), rtol=1e-12, atol=1e-12)


def test_bad_inputs():
    h, w, _, y = _inputs(N=8, ignore=())
    f = tk.fused_linear_cross_entropy
    with pytest.raises(ValueError, match="weight"):
        f(h, w[:, :5], y)
    with pytest.raises(ValueError, match="labels"):
        f(h, w, y[:5])
    bad = y.clone()
    bad[2] = w.shape[0]
    with pytest.raises(ValueError, match="labels"):
        f(h, w, bad)
    bad[2] = -1
    with pytest.raises(ValueError, match="labels"):
        f(h, w, bad)
    with pytest.raises(TypeError, match="labels"):
        f(h, w, y.float())
    with pytest.raises(TypeError, match="hidden"):
        f(h.long(), w, y)
    with pytest.raises(TypeError, match="weight"):
        f(h, w.to(torch.int32), y)
    with pytest.raises(TypeError, match="weight"):
        f(h, w.double(), y)
    with pytest.raises(ValueError, match="bias"):
        f(h, w, y, bias=torch.zeros(3))
    with pytest.raises(ValueError, match="reduction"):
        f(h, w, y, reduction="avg")
    with pytest.raises(ValueError, match="label_smoothing"):
        f(h, w, y, label_smoothing=1.5)
    with pytest.raises(ValueError, match="logit_softcap"):
        f(h, w, y, logit_softcap=0.0)
    with pytest.raises(ValueError, match="temperature"):
        f(h, w, y, temperature=-1.0)
    with pytest.raises(ValueError, match="chunk_size"):
        f(h, w, y, chunk_size=0)
    with pytest.raises(ValueError, match="weight"):
        f(h, w[:0], y)


@pytest.mark.parametrize("backend", FAST)
def test_poisoned_outputs_and_empty(backend):
    _needs_cpu_tensors(backend)
    # conftest poisons every fresh output; zero tokens must still give sum 0 and empty per-token outputs.
    h, w, _, y = _inputs(N=0)
    assert tk.fused_linear_cross_entropy(h, w, y, reduction="sum", backend=backend).item() == 0.0
    loss, lp = tk.fused_linear_cross_entropy(h, w, y, reduction="none", return_logps=True, backend=backend)
    assert loss.shape == (0,) and lp.shape == (0,)


def test_npu_backend_smoke():
    pytest.importorskip("torch_npu")
    if not (hasattr(torch, "npu") and torch.npu.is_available()):
        pytest.skip("no NPU device")
    h, w, _, y = _inputs()
    dev = "npu"
    got = tk.fused_linear_cross_entropy(h.to(dev), w.to(dev), y.to(dev), backend="npu")
    testing.assert_close(got.cpu(), F.cross_entropy(h.double() @ w.double().T, y), torch.float32)


def test_cpu_bar_table_median_ratio():
    # benchmarks/scripts/linear_ce_cpu.py: interleaved rounds give the median of the per-round ratios.
    import argparse
    from benchmarks.scripts.linear_ce_cpu import _table
    args = argparse.Namespace(n=8, h=4, v=16, dtype="bfloat16", reps=1, rounds=3)
    mk = lambda t, p: {"time_s": t, "peak_bytes": p, "loss": 1.0, "load": 0.5}  # noqa: E731
    runs = {"eager": [mk(10.0, 4 << 20), mk(20.0, 4 << 20), mk(10.0, 4 << 20)],
            "twinkle-cpu": [mk(9.0, 1 << 20), mk(30.0, 1 << 20), mk(12.0, 1 << 20)]}
    text = _table(args, ["eager", "twinkle-cpu"], runs)
    row = next(ln for ln in text.splitlines() if ln.startswith("| twinkle-cpu"))
    assert row.split("|")[2:6] == [" 12.00 ", " 1.20 ", " 1 ", " 0.250 "], row  # ratios 0.9, 1.5, 1.2


@pytest.mark.skipif(not cpu_backend_available(), reason="C++ extension not built")
def test_cpu_bar_frozen_weight():
    # --frozen-weight: the weight does not require grad, the table says so, and a provider's step runs.
    import argparse
    from benchmarks.scripts.linear_ce_cpu import _child, _inputs, _table
    args = argparse.Namespace(n=8, h=16, v=40, dtype="bfloat16", reps=1, rounds=1, mode="fwd+bwd",
                              frozen_weight=True, provider="twinkle-cpu")
    h, w, _ = _inputs(args)
    assert h.requires_grad and not w.requires_grad
    res = _child(args)
    assert math.isfinite(res["loss"]) and res["cpu_s"] >= 0, res
    assert _table(args, ["twinkle-cpu"], {"twinkle-cpu": [dict(res, load=0.0)]}).startswith("fwd+bwd, frozen weight,")


@pytest.mark.skipif(not cpu_backend_available(), reason="C++ extension not built")
def test_cpu_extension_schema_is_current(monkeypatch):
    # An extension built before the vocabulary-outer path lacks the vocab_block argument: the cpu
    # backend then says so (and auto dispatch falls back) instead of failing inside the call.
    from twinkle_kernels.linear_ce import _cpu
    assert _cpu.stale_reason() is None
    monkeypatch.setattr(_cpu, "stale_reason", lambda: "stale build")
    h, w, _, y = _inputs(N=4, ignore=())
    with pytest.raises(Exception, match="stale build"):
        tk.fused_linear_cross_entropy(h, w, y, backend="cpu")
    testing.assert_close(tk.fused_linear_cross_entropy(h, w, y), F.cross_entropy(h.double() @ w.double().T, y),
                         torch.float32)


# --- backward twice (retain_graph=True) and the forward alone -------------------------------------

RETAIN_BACKENDS = FAST + ["npu-engine"]


def _slot(backend, monkeypatch):
    """The backend name to call: the NPU backend's chunked torch engine runs through the cpu slot."""
    if backend == "npu-engine":
        from twinkle_kernels.linear_ce import _cpu
        if not cpu_backend_available():
            pytest.skip("the cpu slot is unavailable")
        monkeypatch.setattr(_cpu, "ENGINE", _chunked.TORCH_ENGINE)
        return "cpu"
    return backend


@pytest.mark.parametrize("backend", RETAIN_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kw,bias,N,V,chunk", [
    (dict(), False, 37, 75, 16),                                 # the loss-only mode, tokens in 3 chunks
    (dict(reduction="sum", label_smoothing=0.1), True, 9, 1, 4),  # V = 1, with a bias
    (dict(logit_softcap=3.0, temperature=0.7), False, 1, 13, 8),  # one token
    (dict(return_logps=True), True, 10, 31, 3),                  # the recomputing mode
])
def test_backward_twice_with_retain_graph(backend, dtype, kw, bias, N, V, chunk, monkeypatch):
    # Every backward through a retained graph gives eager's gradients for its own incoming gradient
    # (the loss-only mode's first backward scales the forward's buffers in place; later ones
    # recompute), and none of them changes a gradient an earlier one returned.
    backend = _slot(backend, monkeypatch)
    _needs_cpu_tensors(backend)
    if backend == "triton" and dtype != torch.float32:
        pytest.skip("bf16 math is wrong in the Triton interpreter")
    h, w, b, y = _inputs(N=N, V=V, bias=bias, ignore=(2,))
    leaves = [t.to(dtype).requires_grad_(True) for t in (h, w, b) if t is not None]
    refs = [t.detach().double().requires_grad_(True) for t in leaves]

    def call(fn, ts, **extra):
        out = fn(ts[0], ts[1], y, bias=ts[2] if bias else None, **kw, **extra)
        return out[0] if isinstance(out, tuple) else out

    loss = call(tk.fused_linear_cross_entropy, leaves, backend=backend, chunk_size=chunk)
    exp = torch.autograd.grad(call(ref_fn, refs), refs)
    names, sizes = ("d hidden", "d weight", "d bias"), (V, N, N)
    got = []
    for g in (2.0, -0.5, 1.0):
        grads = torch.autograd.grad(loss, leaves, torch.tensor(g, dtype=loss.dtype), retain_graph=True)
        for i, (t, e) in enumerate(zip(grads, exp)):
            assert t.dtype == dtype
            testing.assert_close(t, e * g, dtype, name=f"{names[i]} x {g}", scale=testing.reduction_scale(sizes[i]))
        got.append((grads, [t.clone() for t in grads]))
    for grads, copies in got:  # no later backward wrote into an earlier one's result
        assert all(torch.equal(t, c) for t, c in zip(grads, copies))
    loss.backward(retain_graph=True)  # .backward() twice accumulates eager's gradients twice
    loss.backward()
    for i, (t, e) in enumerate(zip(leaves, exp)):
        testing.assert_close(t.grad, e * 2, dtype, name=names[i], scale=testing.reduction_scale(sizes[i]))
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()  # without retain_graph the graph is freed, as eager's


@pytest.mark.parametrize("backend", RETAIN_BACKENDS)
def test_all_ignored_backward_twice(backend, monkeypatch):
    backend = _slot(backend, monkeypatch)
    _needs_cpu_tensors(backend)
    h, w, _, y = _inputs(N=5, ignore=range(5))
    hh, ww = h.requires_grad_(True), w.requires_grad_(True)
    loss = tk.fused_linear_cross_entropy(hh, ww, y, reduction="sum", backend=backend, chunk_size=2)
    for g in (3.0, 1.0):
        gh, gw = torch.autograd.grad(loss, (hh, ww), torch.tensor(g), retain_graph=True)
        assert torch.equal(gh, torch.zeros_like(h)) and torch.equal(gw, torch.zeros_like(w))


@pytest.mark.parametrize("backend", RETAIN_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad_off", ["no_grad", "no_leaf"])
def test_forward_alone_computes_no_gradient(backend, dtype, grad_off, monkeypatch):
    # Under torch.no_grad (inputs that require grad: a model's parameters in evaluation) or with no
    # input that requires grad, the op is the forward alone: the engine gets no gradient buffers, no
    # autograd node keeps anything, and the values are the reference's.
    backend = _slot(backend, monkeypatch)
    _needs_cpu_tensors(backend)
    if backend == "triton" and dtype != torch.float32:
        pytest.skip("bf16 math is wrong in the Triton interpreter")
    from twinkle_kernels.linear_ce import _cpu, _triton
    mod, attr = (_triton, "ENGINE") if backend == "triton" else (_cpu, "ENGINE")
    engine = getattr(mod, attr)
    seen = []

    class Spy:
        def __getattr__(self, name):
            return getattr(engine, name)

        def fwd(self, *args):
            seen.append(args[-3:])  # dh, dw, db
            return engine.fwd(*args)

        def bwd(self, *args):
            raise AssertionError("backward ran in a forward-only call")
    monkeypatch.setattr(mod, attr, Spy())
    monkeypatch.setattr(_chunked, "grad_buffers", lambda *a, **k: pytest.fail("a gradient buffer was made"))
    h, w, b, y = _inputs(N=23, V=41, bias=True)
    h, w, b = (t.to(dtype).requires_grad_(grad_off == "no_grad") for t in (h, w, b))
    for kw in (dict(), dict(reduction="none", return_logps=True, return_entropy=True, label_smoothing=0.2)):
        seen.clear()
        with torch.set_grad_enabled(grad_off != "no_grad"):
            out = tk.fused_linear_cross_entropy(h, w, y, bias=b, backend=backend, chunk_size=7, **kw)
        outs = out if isinstance(out, tuple) else (out,)
        assert seen and all(bufs == (None, None, None) for bufs in seen)
        assert all(o.grad_fn is None and not o.requires_grad for o in outs)
        exp = ref_fn(h.detach().double(), w.detach().double(), y, bias=b.detach().double(), **kw)
        exp = exp if isinstance(exp, tuple) else (exp,)
        for i, (g, e) in enumerate(zip(outs, exp)):
            testing.assert_close(g, e, dtype, name=f"output {i}", scale=testing.reduction_scale(h.shape[1]))


@pytest.mark.skipif(not cpu_backend_available(), reason="C++ extension not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("retain", [False, True])
def test_loss_only_gradients_become_grad_without_a_copy(dtype, retain, monkeypatch):
    # The loss-only mode's buffers, scaled in place, are what .grad ends up holding (AccumulateGrad
    # adopts a gradient nobody else references): no second [V, H] buffer, with or without retain_graph.
    made = []
    real = _chunked.grad_buffers

    def spy(*a, **k):
        out = real(*a, **k)
        made.append([t.data_ptr() for t in out[:2]])  # addresses only: a reference would force the copy
        return out
    monkeypatch.setattr(_chunked, "grad_buffers", spy)
    h, w, _, y = _inputs(N=12, H=16, V=40)
    h, w = h.to(dtype).requires_grad_(True), w.to(dtype).requires_grad_(True)
    loss = tk.fused_linear_cross_entropy(h, w, y, backend="cpu")
    loss.backward(torch.tensor(0.5), retain_graph=retain)
    # a copy would be made while the buffer is alive, so at another address
    assert made == [[h.grad.data_ptr(), w.grad.data_ptr()]]


@pytest.mark.skipif(not cpu_backend_available(), reason="C++ extension not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_backward_twice_with_retain_graph(dtype, monkeypatch):
    # Under torch.compile the op is the torch.library custom op (_library): its loss-only backward
    # scales the forward's gradients out of place, so a retained graph serves every backward too.
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    h, w, _, y = _inputs(N=19, H=16, V=40, ignore=(4,))
    h, w = h.to(dtype).requires_grad_(True), w.to(dtype).requires_grad_(True)
    hd, wd = h.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    exp = torch.autograd.grad(F.cross_entropy(hd @ wd.T, y), (hd, wd))
    counter = CompileCounterWithBackend("aot_eager")
    with torch._dynamo.config.patch(disable=False):
        fn = torch.compile(lambda a, b: tk.fused_linear_cross_entropy(a, b, y, backend="cpu"), backend=counter,
                           fullgraph=True)
        loss = fn(h, w)
    assert counter.frame_count == 1
    for g in (2.0, -0.5):
        grads = torch.autograd.grad(loss, (h, w), torch.tensor(g), retain_graph=True)
        for name, t, e, n in zip(("d hidden", "d weight"), grads, exp, (40, 19)):
            testing.assert_close(t, e * g, dtype, name=f"{name} x {g}", scale=testing.reduction_scale(n))


# --- a frozen weight (LoRA's LM head, a tied embedding) ------------------------------------------

@pytest.mark.parametrize("backend", RETAIN_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kw,bias,N,chunk,vocab_block", [
    (dict(), False, 37, 16, 0),                        # loss-only, tokens in 3 chunks
    (dict(), True, 12, 12, 16),                        # loss-only, one chunk: pass 1 parks its blocks
    (dict(reduction="sum", label_smoothing=0.1, logit_softcap=3.0), False, 9, 40, 7),
    (dict(return_logps=True, return_entropy=True), True, 10, 3, 0),   # the recomputing mode
])
def test_frozen_weight_gets_no_gradient_and_hidden_is_exact(backend, dtype, kw, bias, N, chunk, vocab_block,
                                                            monkeypatch):
    # With the weight not requiring grad, the engine is handed no weight-gradient buffer (the C++
    # kernels and the chunk loop then skip that GEMM, a third of the backward), and the hidden's (and
    # bias's) gradients equal the float64 reference's, through a retained graph twice as well.
    from twinkle_kernels.linear_ce import _cpu
    backend = _slot(backend, monkeypatch)
    _needs_cpu_tensors(backend)
    if backend == "triton" and dtype != torch.float32:
        pytest.skip("bf16 math is wrong in the Triton interpreter")
    engine = _cpu.ENGINE if backend == "cpu" else None
    if backend == "cpu" and isinstance(engine, _cpu.CppEngine):
        monkeypatch.setattr(engine, "vocab_block", vocab_block)
    assert engine is None or engine.optional_dw
    h, w, b, y = _inputs(N=N, V=75, bias=bias, ignore=(2,))
    hh = h.to(dtype).requires_grad_(True)
    ww = w.to(dtype)                                   # frozen
    bb = None if b is None else b.to(dtype).requires_grad_(True)
    seen = []
    if engine is not None:
        for name in ("fwd", "bwd"):
            real = getattr(engine, name)

            def spy(*a, real=real):
                seen.append(a[-2])       # the dw argument
                return real(*a)
            monkeypatch.setattr(engine, name, spy)
    out = tk.fused_linear_cross_entropy(hh, ww, y, bias=bb, backend=backend, chunk_size=chunk, **kw)
    outs = out if isinstance(out, tuple) else (out,)
    coefs = [torch.randn(o.shape, dtype=torch.float64) for o in outs]
    total = sum((o.double() * c).sum() for o, c in zip(outs, coefs))
    leaves = [t for t in (hh, bb) if t is not None]
    got = torch.autograd.grad(total, leaves, retain_graph=True)
    again = torch.autograd.grad(total, leaves)
    rh = h.double().requires_grad_(True)
    rb = None if b is None else b.double().requires_grad_(True)
    rout = ref_fn(rh, w.double(), y, bias=rb, **kw)
    routs = rout if isinstance(rout, tuple) else (rout,)
    exp = torch.autograd.grad(sum((o * c).sum() for o, c in zip(routs, coefs)), [t for t in (rh, rb) if t is not None])
    for name, g1, g2, e, n in zip(("d hidden", "d bias"), got, again, exp, (75, N)):
        testing.assert_close(g1, e, dtype, name=name, scale=testing.reduction_scale(n))
        testing.assert_close(g2, e, dtype, name=name + " (second backward)", scale=testing.reduction_scale(n))
    if engine is not None:
        assert seen and all(dw is None for dw in seen), seen


# --- expected_logps_grad: the gradients computed in the forward for an expected logps gradient -----

def _spy_bwd(monkeypatch, backend):
    """Counts the engine's recomputing backward calls (the cpu slot's engine)."""
    from twinkle_kernels.linear_ce import _cpu
    calls = []
    engine = _cpu.ENGINE
    real = engine.bwd
    monkeypatch.setattr(engine, "bwd", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    return calls


@pytest.mark.parametrize("backend", RETAIN_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kw,bias,N,V,chunk", [
    (dict(), False, 37, 75, 16),                                         # tokens in 3 chunks
    (dict(temperature=0.7, logit_softcap=3.0), True, 12, 75, 12),        # one chunk, with a bias
    (dict(reduction="none"), False, 1, 13, 8),                           # one token
])
@pytest.mark.parametrize("incoming", ["scaled", "other", "with_loss", "twice", "frozen"])
def test_expected_logps_grad(backend, dtype, kw, bias, N, V, chunk, incoming, monkeypatch):
    # A backward whose logps gradient is s * expected uses the forward's gradients (no recompute);
    # any other recomputes. Either way the gradients are the float64 reference's, for the
    # incoming gradient actually given.
    backend = _slot(backend, monkeypatch)
    _needs_cpu_tensors(backend)
    if backend == "triton" and dtype != torch.float32:
        pytest.skip("bf16 math is wrong in the Triton interpreter")
    calls = _spy_bwd(monkeypatch, backend) if backend == "cpu" else None
    h, w, b, y = _inputs(N=N, V=V, bias=bias, ignore=(2,))
    mask = torch.rand(N) > 0.3
    mask[0] = True
    expected = -mask.to(torch.float32)
    s = -0.37
    g_logp = {"scaled": s * expected, "other": torch.randn(N), "with_loss": s * expected,
              "twice": s * expected, "frozen": s * expected}[incoming]
    g_loss = torch.randn(N if kw.get("reduction") == "none" else ()) if incoming == "with_loss" else None
    leaves = [h.to(dtype).requires_grad_(True), w.to(dtype).requires_grad_(incoming != "frozen")]
    if bias:
        leaves.append(b.to(dtype).requires_grad_(True))
    loss, logp = tk.fused_linear_cross_entropy(leaves[0], leaves[1], y, bias=leaves[2] if bias else None,
                                               backend=backend, chunk_size=chunk, return_logps=True,
                                               expected_logps_grad=expected, **kw)
    outs, gs = [logp], [g_logp.to(torch.float32)]
    if g_loss is not None:
        outs, gs = [loss, logp], [g_loss.to(torch.float32), g_logp.to(torch.float32)]
    wanted = [t for t in leaves if t.requires_grad]
    got = torch.autograd.grad(outs, wanted, gs, retain_graph=incoming == "twice")
    if incoming == "twice":   # a second backward through the retained graph recomputes
        again = torch.autograd.grad(outs, wanted, gs)
    refs = [t.detach().double().requires_grad_(t.requires_grad) for t in leaves]
    rloss, rlogp = ref_fn(refs[0], refs[1], y, bias=refs[2] if bias else None, return_logps=True, **kw)
    total = (rlogp * g_logp.double()).sum() + ((rloss * g_loss.double()).sum() if g_loss is not None else 0)
    exp = torch.autograd.grad(total, [r for r in refs if r.requires_grad])
    testing.assert_close(logp.detach(), rlogp.detach(), dtype, name="logps", scale=testing.reduction_scale(h.shape[1]))
    for name, g, e in zip(("d hidden", "d weight", "d bias"), got, exp):
        assert g.dtype == dtype
        n = V if name == "d hidden" else N
        testing.assert_close(g, e, dtype, name=name, scale=testing.reduction_scale(n))
    if incoming == "twice":
        for name, g, e in zip(("d hidden", "d weight", "d bias"), again, exp):
            n = V if name == "d hidden" else N
            testing.assert_close(g, e, dtype, name=name + " (second backward)", scale=testing.reduction_scale(n))
    if calls is not None:
        # one token: any logps gradient is a multiple of the expected one
        recomputes = {"scaled": 0, "frozen": 0, "other": int(N > 1), "with_loss": 1, "twice": 1}[incoming]
        assert len(calls) == recomputes, (incoming, calls)


def test_expected_logps_grad_bad_inputs():
    h, w, _, y = _inputs(N=6, V=11, ignore=())
    f = tk.fused_linear_cross_entropy
    with pytest.raises(ValueError, match="expected_logps_grad needs return_logps"):
        f(h, w, y, expected_logps_grad=torch.ones(6))
    with pytest.raises(ValueError, match="expected_logps_grad needs return_logps"):
        f(h, w, y, return_logps=True, return_entropy=True, expected_logps_grad=torch.ones(6))
    with pytest.raises(ValueError, match="expected_logps_grad must have labels' shape"):
        f(h, w, y, return_logps=True, expected_logps_grad=torch.ones(5))
    with pytest.raises(TypeError, match="expected_logps_grad must be a floating-point"):
        f(h, w, y, return_logps=True, expected_logps_grad=torch.ones(6, dtype=torch.int64))
    with pytest.raises(TypeError, match="expected_logps_grad must be a floating-point"):
        f(h, w, y, return_logps=True, expected_logps_grad=[1.0] * 6)
