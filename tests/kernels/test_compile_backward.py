"""The custom ops' backward (row-wise ops, grouped matmul, causal conv1d, fused cross-entropy) under torch.compile: the backend's own backward kernel, fed with
the statistics the forward op returned (``twinkle_kernels.norm._library`` and the other ops' ``_library``), never a rerun of the forward.

Each op alone, compiled (aot_eager) per backend, against the same backend called eagerly (the
autograd Functions: the same kernels, so near-exact) and against the float64 reference (the
tolerance table); the kernels' calls are counted to show the backward runs no forward.
"""
from __future__ import annotations

import pytest
import torch

import twinkle_kernels as tk
from twinkle_kernels import _dispatch, testing
from twinkle_kernels.norm import _library as norm_library
from twinkle_kernels.gdn import causal_conv1d_reference
from twinkle_kernels.linear_ce import fused_linear_cross_entropy_reference
from twinkle_kernels.moe import grouped_matmul_reference
from twinkle_kernels.norm import gated_rms_norm_reference, rms_norm_reference
from twinkle_kernels.rope import apply_rotary_pos_emb_reference
from twinkle_kernels.swiglu import swiglu_packed_reference, swiglu_reference

pytestmark = [pytest.mark.filterwarnings("ignore"), pytest.mark.timeout(600)]


@pytest.fixture(autouse=True)
def _dynamo_enabled(monkeypatch):
    import torch._dynamo
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    with torch._dynamo.config.patch(disable=False):
        yield


def _cases():
    """(op, fn(backend) -> function of the tensors, the float64 reference function, inputs): odd sizes,
    a non-contiguous x, the zero-centred weight, partial rotary with GQA heads."""
    g = torch.Generator().manual_seed(7)

    def r(*s):
        return torch.randn(*s, generator=g, dtype=torch.float64)
    yield ("rms_norm", lambda b: lambda x, w: tk.rms_norm(x, w, 1e-5, offset=1.0, backend=b),
           lambda x, w: rms_norm_reference(x, w, 1e-5, 1.0), (r(37, 5).t(), r(37) * 0.1))
    yield ("rms_norm", lambda b: lambda x, w: tk.rms_norm(x, w, 1e-6, backend=b),
           lambda x, w: rms_norm_reference(x, w, 1e-6), (r(2, 3, 40), r(40)))
    yield ("gated_rms_norm", lambda b: lambda x, z, w: tk.gated_rms_norm(x, z, w, 1e-6, backend=b),
           lambda x, z, w: gated_rms_norm_reference(x, z, w, 1e-6), (r(3, 7, 24), r(3, 7, 24), r(24)))
    yield ("swiglu", lambda b: lambda a, u: tk.swiglu(a, u, backend=b), swiglu_reference, (r(5, 33), r(5, 33)))
    yield ("swiglu_packed", lambda b: lambda x: tk.swiglu_packed(x, backend=b), swiglu_packed_reference,
           (r(2, 3, 34),))
    cos, sin = r(2, 6, 8), r(2, 6, 8)
    yield ("apply_rotary_pos_emb",
           lambda b: lambda q, k: tk.apply_rotary_pos_emb(q, k, cos.float(), sin.float(), backend=b),
           lambda q, k: apply_rotary_pos_emb_reference(q, k, cos, sin), (r(2, 4, 6, 16), r(2, 2, 6, 16)))
    offs = torch.tensor([3, 3, 9, 13], dtype=torch.int32)  # an empty group; HF's [E, N, K] weight viewed
    yield ("grouped_matmul", lambda b: lambda x, w: tk.grouped_matmul(x, w.transpose(1, 2), offs, backend=b),
           lambda x, w: grouped_matmul_reference(x, w.transpose(1, 2), offs), (r(13, 12), r(4, 10, 12)))
    cu = torch.tensor([0, 5, 5, 12], dtype=torch.int32)  # packed, with an empty sequence
    yield ("causal_conv1d", lambda b: lambda x, w, bias: tk.causal_conv1d(x, w, bias, "silu", cu, backend=b),
           lambda x, w, bias: causal_conv1d_reference(x, w, bias, "silu", cu), (r(1, 6, 12), r(6, 4), r(6)))
    yield ("causal_conv1d", lambda b: lambda x, w: tk.causal_conv1d(x, w, None, None, backend=b),
           lambda x, w: causal_conv1d_reference(x, w, None, None), (r(2, 5, 9), r(5, 3)))
    # loss only (the gradients computed in the forward op) and per-token outputs (lse to the backward)
    y = torch.tensor([3, -100, 0, 10, 7, 2, -100, 1, 5, 9, 4])
    kw = dict(ignore_index=-100, label_smoothing=0.1, logit_softcap=5.0, temperature=0.7)
    yield ("fused_linear_cross_entropy",
           lambda b: lambda h, w, bias: tk.fused_linear_cross_entropy(h, w, y, bias=bias, chunk_size=4, backend=b, **kw),
           lambda h, w, bias: fused_linear_cross_entropy_reference(h, w, y, bias=bias, **kw),
           (r(11, 8), r(13, 8), r(13)))
    yield ("fused_linear_cross_entropy",
           lambda b: lambda h, w: tk.fused_linear_cross_entropy(h, w, y, reduction="none", return_logps=True,
                                                                return_entropy=True, chunk_size=4, backend=b),
           lambda h, w: fused_linear_cross_entropy_reference(h, w, y, reduction="none", return_logps=True,
                                                             return_entropy=True), (r(11, 8), r(13, 8)))


def _backends():
    out = ["reference", "cpu"]
    if _dispatch.backend_status("triton") is None and _dispatch.triton_interpret():
        out.append("triton")
    return out


def _grads(fn, inputs):
    """Outputs and input gradients of ``sum(out * weights)`` (fixed, non-uniform weights)."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    loss = sum((o.double() * torch.linspace(-1, 2, o.numel(), dtype=torch.float64).view(o.shape)).sum()
               for o in outs)
    return [o.detach() for o in outs], list(torch.autograd.grad(loss, leaves))


def _on32(inputs):
    """fp32 copies with the same strides (the non-contiguous case stays non-contiguous)."""
    out = []
    for t in inputs:
        b = torch.empty_strided(t.shape, t.stride(), dtype=torch.float32)
        b.copy_(t)
        out.append(b)
    return out


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("case", list(_cases()), ids=lambda c: c[0])
def test_compiled_op_equals_eager_and_reference(case, backend):
    if backend == "cpu" and _dispatch.backend_status("cpu") is not None:
        pytest.skip("the C++ extension is not built")
    name, make, reference, inputs = case
    torch._dynamo.reset()
    fn = make(backend)
    x32 = _on32(inputs)
    want_outs, want_grads = _grads(fn, x32)
    got_outs, got_grads = _grads(torch.compile(fn, fullgraph=True, backend="aot_eager"), x32)
    ref_outs, ref_grads = _grads(reference, inputs)
    names = [f"out{i}" for i in range(len(got_outs))] + [f"grad{i}" for i in range(len(got_grads))]
    for label, got, want, ref in zip(names, got_outs + got_grads, want_outs + want_grads, ref_outs + ref_grads):
        # the same kernels as eager, in the same order: equal up to the last bit or two
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6, msg=lambda m: f"{name} {label}: {m}")
        scale = testing.reduction_scale(inputs[0].numel() // inputs[0].shape[-1]) if got.dim() == 1 else 1.0
        testing.assert_close(got, ref, torch.float32, name=f"{name} {label}", scale=scale)


def _counting(monkeypatch, op_name: str, calls: dict):
    """Wraps the cpu backend's forward and backward of ``op_name`` so their calls are counted."""
    op = _dispatch.op(op_name)
    impl, stages = op.impls["cpu"], op.stages["cpu"]

    def count(key, f):
        def wrapped(*a, **k):
            calls[key] += 1
            return f(*a, **k)
        return wrapped
    monkeypatch.setitem(op.impls, "cpu", _dispatch._Impl(count("forward", impl.fn), impl.verify))
    fwd = count("forward", stages.forward) if stages.forward is not None else None
    # the loss-only cross entropy computes its gradients in the forward op: no backward call
    monkeypatch.setitem(op.stages, "cpu", _dispatch.Stages(fwd, count("backward", stages.backward)))


@pytest.mark.parametrize("case", list(_cases())[1:], ids=lambda c: c[0])
def test_compiled_backward_reruns_no_forward(case, monkeypatch):
    """With the cpu backend, the compiled backward calls the backward kernel once and no forward (the
    loss-only cross entropy: neither, its forward op computed the gradients)."""
    if _dispatch.backend_status("cpu") is not None:
        pytest.skip("the C++ extension is not built")
    name, make, _, inputs = case
    torch._dynamo.reset()
    calls = {"forward": 0, "backward": 0}
    _counting(monkeypatch, name, calls)
    leaves = [t.detach().float().requires_grad_() for t in inputs]
    out = torch.compile(make("cpu"), fullgraph=True, backend="aot_eager")(*leaves)
    assert calls == {"forward": 1, "backward": 0}
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    loss_only = name == "fused_linear_cross_entropy" and not isinstance(out, tuple)
    assert calls == {"forward": 1, "backward": 0 if loss_only else 1}
    assert all(t.grad is not None for t in leaves)


def test_norm_forward_op_returns_rstd():
    """The statistics output is the rstd of every row, in fp32 (fp64 on the float64 reference), for
    every backend alike, so a backward on another backend than the forward's is still right."""
    x, w = torch.randn(3, 4, 24), torch.randn(24)
    want = torch.rsqrt(x.double().pow(2).mean(-1) + 1e-6)
    for backend in _backends():
        if backend == "cpu" and _dispatch.backend_status("cpu") is not None:
            continue
        y, rstd = torch.ops.twinkle.rms_norm(x, w, 1e-6, 0.0, backend)
        assert rstd.shape == (3, 4) and rstd.dtype == torch.float32
        testing.assert_close(rstd, want, name=f"rstd {backend}")
        _, rstd_g = torch.ops.twinkle.gated_rms_norm(x, torch.randn_like(x), w, 1e-6, backend)
        testing.assert_close(rstd_g, want, name=f"gated rstd {backend}")
    _, rstd64 = torch.ops.twinkle.rms_norm(x.double(), w.double(), 1e-6, 0.0, None)
    assert rstd64.dtype == torch.float64
    # cpu's forward statistics fed to the reference's backward and back: the same gradients
    dy = torch.randn_like(x)
    for fwd_b, bwd_b in (("cpu", "reference"), ("reference", "cpu")):
        if _dispatch.backend_status("cpu") is not None:
            break
        _, rstd = torch.ops.twinkle.rms_norm(x, w, 1e-6, 0.0, fwd_b)
        got = norm_library.rms_norm_backward(dy, x, w, rstd, 1e-6, 0.0, bwd_b)
        xl, wl = x.double().requires_grad_(), w.double().requires_grad_()
        want_g = torch.autograd.grad(rms_norm_reference(xl, wl, 1e-6), (xl, wl), dy.double())
        testing.assert_close(got[0], want_g[0], name=f"dx {fwd_b}->{bwd_b}")
        testing.assert_close(got[1], want_g[1], name=f"dw {fwd_b}->{bwd_b}", scale=testing.reduction_scale(12))


def test_opcheck_cross_entropy_gradients_in_forward():
    """The loss-only mode's op (gradients as extra outputs) is a sound custom op too."""
    g = torch.Generator().manual_seed(1)
    y = torch.tensor([3, -100, 0, 10, 7, 2, -100, 1, 5])
    for backend in _backends():
        if backend == "cpu" and _dispatch.backend_status("cpu") is not None:
            continue
        for bias in (None, torch.randn(11, generator=g).requires_grad_()):
            args = (torch.randn(9, 8, generator=g).requires_grad_(), torch.randn(11, 8, generator=g).requires_grad_(),
                    bias, y, -100, 0.1, 0.0, 1.0, "mean", False, False, 4, backend, True)
            torch.library.opcheck(torch.ops.twinkle.fused_linear_cross_entropy.default, args)


def test_compiled_bf16_equals_eager_on_cpu():
    """bf16 activations with an fp32 weight (the norms' rstd stays fp32): compiled == eager."""
    if _dispatch.backend_status("cpu") is not None:
        pytest.skip("the C++ extension is not built")
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(5)
    x, z = (torch.randn(3, 7, 40, generator=g).bfloat16() for _ in range(2))
    w = torch.randn(40, generator=g)

    def f(x, z, w):
        return tk.swiglu(tk.gated_rms_norm(tk.rms_norm(x, w, offset=1.0), z, w), x)
    _, rstd = torch.ops.twinkle.rms_norm(x, w, 1e-6, 1.0, "cpu")
    assert rstd.dtype == torch.float32
    want = _grads(f, (x, z, w))
    got = _grads(torch.compile(f, fullgraph=True, backend="aot_eager"), (x, z, w))
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_cross_entropy_lse_is_the_same_for_every_backend():
    """The per-token backward's statistic (lse per row, 0 on ignored rows) agrees across backends."""
    g = torch.Generator().manual_seed(2)
    h, w, b = torch.randn(9, 8, generator=g), torch.randn(11, 8, generator=g), torch.randn(11, generator=g)
    y = torch.tensor([3, -100, 0, 10, 7, 2, -100, 1, 5])
    got = {be: torch.ops.twinkle.fused_linear_cross_entropy(h, w, b, y, -100, 0.1, 5.0, 0.7, "none", True, True, 4,
                                                            be)[3] for be in _backends()
           if not (be == "cpu" and _dispatch.backend_status("cpu") is not None)}
    assert torch.equal(got["reference"][y == -100], torch.zeros(2))
    for be, lse in got.items():
        testing.assert_close(lse, got["reference"].double(), name=f"lse {be}")
