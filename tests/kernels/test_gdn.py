"""Gated delta rule (chunked and fused recurrent) on every backend against the float64 recurrence."""
import pytest
import torch
import torch.nn.functional as F

import twinkle_kernels as tk
from twinkle_kernels import _dispatch, testing
from twinkle_kernels.gdn import gated_delta_rule_reference

from conftest import available_backends

OP = "gated_delta_rule"


def _serving(name):
    """Backends of this machine that serve op ``name`` (triton appears once its kernels exist)."""
    q, v = torch.randn(1, 4, 1, 8), torch.randn(1, 4, 1, 8)
    g, beta = -torch.rand(1, 4, 1), torch.rand(1, 4, 1)
    op = _dispatch.op(name)
    return [b for b in available_backends()
            if op.reason(b, q, q, v, g, beta, 8 ** -0.5, None, False, False, None, 64) is None]


BACKENDS = _serving("chunk_gated_delta_rule")
RECURRENT_BACKENDS = _serving("fused_recurrent_gated_delta_rule")

# (H, HV, K, V, initial state, qk-l2norm): every flag is on in some rows and off in others,
# H == HV and HV == 2H, K != V both ways.
CONFIGS = {
    "mha-K16V32-h0-l2": (2, 2, 16, 32, True, True),
    "gva-K32V16": (1, 2, 32, 16, False, False),
    "gva-K16V16-h0": (1, 2, 16, 16, True, False),
    "mha-K32V16-l2": (2, 2, 32, 16, False, True),
}


def _skip_unsupported(backend, dtype):
    if backend == "triton" and _dispatch.triton_interpret() and dtype != torch.float32:
        pytest.skip("bf16 math is wrong in the Triton interpreter")


def make_inputs(B, T, H, HV, K, V, dtype, h0, l2, n_states=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    if not l2:
        # unit keys keep the un-normalised delta rule stable (beta * |k|^2 <= 1)
        k = F.normalize(k, dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, HV, generator=gen) + 1.5)  # fp32, as Qwen3.5 computes it
    beta = torch.sigmoid(torch.randn(B, T, HV, generator=gen))
    s0 = torch.randn(n_states or B, HV, K, V, generator=gen) * 0.5 if h0 else None
    ins = [q.to(dtype), k.to(dtype), v.to(dtype), g, beta.to(dtype)]
    return ins, s0


def _leaves(ts, dtype=None):
    return [None if t is None else t.detach().to(dtype or t.dtype).requires_grad_(True) for t in ts]


def run(fn, ins, s0, do, dsT, **kw):
    """Output, final state and gradients of sum(o * do) + sum(final * dsT) wrt inputs and s0."""
    leaves = _leaves(ins + [s0])
    o, sT = fn(*leaves[:5], initial_state=leaves[5], output_final_state=True, **kw)
    loss = (o.double() * do).sum() + (sT.double() * dsT).sum()
    return o, sT, _grads(loss, leaves)


def _grads(loss, leaves):
    # an empty sequence leaves its inputs out of the graph: their gradient is zero
    wrt = [t for t in leaves if t is not None]
    grads = torch.autograd.grad(loss, wrt, allow_unused=True)
    return [torch.zeros_like(t) if d is None else d for t, d in zip(wrt, grads)]


def ground_truth(ins, s0, do, dsT, **kw):
    kw = {k: v for k, v in kw.items() if k not in ("backend", "chunk_size")}
    leaves = _leaves(ins + [s0], torch.float64)
    o, sT = gated_delta_rule_reference(*leaves[:5], initial_state=leaves[5], output_final_state=True, **kw)
    loss = (o * do).sum() + (sT * dsT).sum()
    return o, sT, _grads(loss, leaves)


def compare(got, want, dtype, names):
    o, sT, grads = got
    o64, sT64, grads64 = want
    testing.assert_close(o, o64, dtype, op=OP, name="o")
    testing.assert_close(sT, sT64, dtype, op=OP, name="final_state")
    for n, a, b in zip(names, grads, grads64):
        testing.assert_close(a, b, dtype, op=OP, name=f"d{n}")


NAMES = ["q", "k", "v", "g", "beta", "initial_state"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("backend", BACKENDS)
def test_chunk_matches_float64_recurrence(backend, T, config, dtype):
    _skip_unsupported(backend, dtype)
    H, HV, K, V, h0, l2 = CONFIGS[config]
    B = 2 if T < 100 else 1
    ins, s0 = make_inputs(B, T, H, HV, K, V, dtype, h0, l2, seed=T)
    do = torch.randn(B, T, HV, V, dtype=torch.float64)
    dsT = torch.randn(B, HV, K, V, dtype=torch.float64)
    kw = dict(use_qk_l2norm_in_kernel=l2, backend=backend)
    got = run(tk.chunk_gated_delta_rule, ins, s0, do, dsT, **kw)
    assert got[1].dtype == torch.float32 and got[0].dtype == dtype
    compare(got, ground_truth(ins, s0, do, dsT, **kw), dtype, NAMES)


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_equals_separate_calls(backend):
    """Sequences of length 1, 29, 0 (middle), 65, 0 (empty tail): outputs, states, gradients."""
    H, HV, K, V = 1, 2, 16, 32
    cu = [0, 1, 30, 30, 95, 95]
    N, T = len(cu) - 1, cu[-1]
    ins, s0 = make_inputs(1, T, H, HV, K, V, torch.float32, True, True, n_states=N, seed=7)
    do = torch.randn(1, T, HV, V, dtype=torch.float64)
    dsT = torch.randn(N, HV, K, V, dtype=torch.float64)
    kw = dict(use_qk_l2norm_in_kernel=True, backend=backend, chunk_size=16)
    o, sT, grads = run(tk.chunk_gated_delta_rule, ins, s0, do, dsT,
                       cu_seqlens=torch.tensor(cu, dtype=torch.int32), **kw)
    for n in range(N):
        a, b = cu[n], cu[n + 1]
        piece = [t[:, a:b] for t in ins]
        o_n, sT_n, g_n = run(tk.chunk_gated_delta_rule, piece, s0[n:n + 1], do[:, a:b], dsT[n:n + 1], **kw)
        testing.assert_close(o[:, a:b], o_n.double(), torch.float32, op=OP, name=f"o of sequence {n}")
        testing.assert_close(sT[n:n + 1], sT_n.double(), torch.float32, op=OP, name=f"state of sequence {n}")
        for name, full, part in zip(NAMES[:5], grads[:5], g_n[:5]):
            testing.assert_close(full[:, a:b], part.double(), torch.float32, op=OP, name=f"d{name} of sequence {n}")
        testing.assert_close(grads[5][n:n + 1], g_n[5].double(), torch.float32, op=OP, name=f"dh0 of sequence {n}")
    # and the packed call itself against the float64 recurrence
    want = ground_truth(ins, s0, do, dsT, cu_seqlens=torch.tensor(cu), use_qk_l2norm_in_kernel=True)
    compare((o, sT, grads), want, torch.float32, NAMES)


@pytest.mark.parametrize("backend", RECURRENT_BACKENDS)
def test_fused_recurrent_matches_chunked_and_carries_state(backend):
    """The decoding form agrees with the chunked form, also one token at a time with the state carried."""
    H, HV, K, V, T = 1, 2, 16, 32, 37
    ins, s0 = make_inputs(2, T, H, HV, K, V, torch.float32, True, True, seed=3)
    o_c, s_c = tk.chunk_gated_delta_rule(*ins, initial_state=s0, output_final_state=True,
                                         use_qk_l2norm_in_kernel=True,
                                         backend=backend if backend in BACKENDS else "reference")
    o_r, s_r = tk.fused_recurrent_gated_delta_rule(*ins, initial_state=s0, output_final_state=True,
                                                   use_qk_l2norm_in_kernel=True, backend=backend)
    o64, s64 = gated_delta_rule_reference(*[t.double() for t in ins], initial_state=s0.double(),
                                          output_final_state=True, use_qk_l2norm_in_kernel=True)
    for o, s, form in ((o_c, s_c, "chunk"), (o_r, s_r, "recurrent")):
        testing.assert_close(o, o64, torch.float32, op=OP, name=f"{form} o")
        testing.assert_close(s, s64, torch.float32, op=OP, name=f"{form} state")
    state, outs = s0, []
    for t in range(T):
        o_t, state = tk.fused_recurrent_gated_delta_rule(*[x[:, t:t + 1] for x in ins], initial_state=state,
                                                         output_final_state=True, use_qk_l2norm_in_kernel=True,
                                                         backend=backend)
        outs.append(o_t)
    testing.assert_close(torch.cat(outs, 1), o64, torch.float32, op=OP, name="decoded o")
    testing.assert_close(state, s64, torch.float32, op=OP, name="decoded state")


@pytest.mark.parametrize("backend", RECURRENT_BACKENDS)
def test_fused_recurrent_packed(backend):
    cu = [0, 1, 20, 20]
    ins, s0 = make_inputs(1, 20, 2, 2, 16, 16, torch.float32, True, False, n_states=3, seed=5)
    cu_t = torch.tensor(cu)
    o, s = tk.fused_recurrent_gated_delta_rule(*ins, initial_state=s0, output_final_state=True, cu_seqlens=cu_t,
                                               backend=backend)
    o64, s64 = gated_delta_rule_reference(*[t.double() for t in ins], initial_state=s0.double(),
                                          output_final_state=True, cu_seqlens=cu_t)
    testing.assert_close(o, o64, torch.float32, op=OP, name="o")
    testing.assert_close(s, s64, torch.float32, op=OP, name="state")


def test_fused_recurrent_with_gradients_falls_back_to_reference():
    ins, s0 = make_inputs(1, 9, 1, 1, 8, 8, torch.float32, True, True, seed=2)
    leaves = _leaves(ins)
    o, _ = tk.fused_recurrent_gated_delta_rule(*leaves, initial_state=s0, use_qk_l2norm_in_kernel=True)
    o.sum().backward()
    want = _leaves(ins)
    o_ref, _ = gated_delta_rule_reference(*want, initial_state=s0, use_qk_l2norm_in_kernel=True)
    o_ref.sum().backward()
    for n, a, b in zip(NAMES, leaves, want):
        testing.assert_close(a.grad, b.grad.double(), torch.float32, op=OP, name=f"d{n}")


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])
@pytest.mark.parametrize("chunk_size", [16, 32, 128])
def test_chunk_size_does_not_change_the_result(backend, chunk_size):
    ins, s0 = make_inputs(1, 150, 1, 2, 16, 16, torch.float32, True, True, seed=11)
    do = torch.randn(1, 150, 2, 16, dtype=torch.float64)
    dsT = torch.randn(1, 2, 16, 16, dtype=torch.float64)
    kw = dict(use_qk_l2norm_in_kernel=True, backend=backend, chunk_size=chunk_size)
    compare(run(tk.chunk_gated_delta_rule, ins, s0, do, dsT, **kw), ground_truth(ins, s0, do, dsT, **kw),
            torch.float32, NAMES)


@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_transformers_torch_chunk_gated_delta_rule(backend):
    m = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    ins, s0 = make_inputs(2, 70, 2, 4, 16, 32, torch.float32, True, True, seed=13)
    # q/k repeated per value head here: transformers 5.17 (on the lent GPU machines) wants as many key
    # heads as value heads; 5.23 repeats them inside the function in the same way
    rep = ins[2].shape[2] // ins[0].shape[2]
    hf_ins = [t.double().repeat_interleave(rep, 2) if i < 2 else t.double() for i, t in enumerate(ins)]
    o_hf, s_hf = m.torch_chunk_gated_delta_rule(*hf_ins, initial_state=s0.double(),
                                                output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, s = tk.chunk_gated_delta_rule(*ins, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                     backend=backend)
    # transformers computes in fp32 whatever the input dtype: compare at fp32 tolerance
    testing.assert_close(o, o_hf.double(), torch.float32, op=OP, name="o vs transformers")
    testing.assert_close(s, s_hf.double(), torch.float32, op=OP, name="state vs transformers")


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_inputs(backend):
    ins, s0 = make_inputs(1, 40, 2, 2, 16, 16, torch.float32, True, True, seed=17)
    # the same values, laid out [B, H, T, K] and viewed back as [B, T, H, K]
    strided = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in ins[:3]] + ins[3:]
    assert not strided[0].is_contiguous()
    o, s = tk.chunk_gated_delta_rule(*strided, initial_state=s0, output_final_state=True,
                                     use_qk_l2norm_in_kernel=True, backend=backend)
    o64, s64 = gated_delta_rule_reference(*[t.double() for t in ins], initial_state=s0.double(),
                                          output_final_state=True, use_qk_l2norm_in_kernel=True)
    testing.assert_close(o, o64, torch.float32, op=OP)
    testing.assert_close(s, s64, torch.float32, op=OP, name="state")


def test_scale_argument():
    ins, _ = make_inputs(1, 20, 1, 1, 16, 16, torch.float32, False, True, seed=19)
    o1, _ = tk.chunk_gated_delta_rule(*ins, scale=0.5, use_qk_l2norm_in_kernel=True)
    o2, _ = tk.chunk_gated_delta_rule(*ins, scale=1.0, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o1 * 2, o2, atol=1e-5, rtol=1e-5)


def test_default_dispatch_on_cpu_never_picks_triton():
    ins, _ = make_inputs(1, 5, 1, 1, 8, 8, torch.float32, False, True)
    op = _dispatch.op("chunk_gated_delta_rule")
    chosen = op.select(ins[0].device, None, *ins, 8 ** -0.5, None, False, True, None, 64)
    assert chosen in ("cpu", "reference")


def test_triton_verifier_explains_a_missing_function():
    from twinkle_kernels import gdn
    fn, why = gdn._triton_fn("no_such_function")
    assert fn is None and ("no_such_function" in why or "not importable" in why)


# --- bad input ----------------------------------------------------------------------------------

def _good():
    B, T, H, HV, K, V = 1, 6, 2, 4, 8, 4
    return dict(q=torch.randn(B, T, H, K), k=torch.randn(B, T, H, K), v=torch.randn(B, T, HV, V),
                g=-torch.rand(B, T, HV), beta=torch.rand(B, T, HV))


BAD = [
    ("q", lambda a: a.update(q=torch.randn(1, 6, 2)), ValueError, "q must be 4-D"),
    ("k shape", lambda a: a.update(k=torch.randn(1, 6, 2, 4)), ValueError, "k has shape"),
    ("v batch", lambda a: a.update(v=torch.randn(1, 5, 4, 4)), ValueError, "v must have shape"),
    ("HV % H", lambda a: a.update(v=torch.randn(1, 6, 3, 4), g=-torch.rand(1, 6, 3), beta=torch.rand(1, 6, 3)),
     ValueError, "HV % H"),
    ("g shape", lambda a: a.update(g=torch.randn(1, 6, 2)), ValueError, "g must have shape"),
    ("beta shape", lambda a: a.update(beta=torch.randn(1, 6, 4, 1)), ValueError, "beta must have shape"),
    ("int q", lambda a: a.update(q=torch.ones(1, 6, 2, 8, dtype=torch.int64)), TypeError, "q must be a floating"),
    ("int beta", lambda a: a.update(beta=torch.ones(1, 6, 4, dtype=torch.int32)), TypeError, "beta must be a floating"),
    ("dtype mix", lambda a: a.update(v=a["v"].double()), TypeError, "v has dtype"),
    ("scale", lambda a: a.update(scale=-1.0), ValueError, "scale must be"),
    ("cu B>1", lambda a: a.update(q=torch.randn(2, 6, 2, 8), k=torch.randn(2, 6, 2, 8), v=torch.randn(2, 6, 4, 4),
                                  g=-torch.rand(2, 6, 4), beta=torch.rand(2, 6, 4), cu_seqlens=torch.tensor([0, 6])),
     ValueError, "cu_seqlens needs packed inputs with batch size 1"),
    ("cu decreasing", lambda a: a.update(cu_seqlens=torch.tensor([0, 4, 2, 6])), ValueError, "cu_seqlens must be non-decreasing"),
    ("cu start", lambda a: a.update(cu_seqlens=torch.tensor([1, 6])), ValueError, "cu_seqlens must start at 0"),
    ("cu end", lambda a: a.update(cu_seqlens=torch.tensor([0, 5])), ValueError, "cu_seqlens must end at"),
    ("cu float", lambda a: a.update(cu_seqlens=torch.tensor([0.0, 6.0])), TypeError, "cu_seqlens must be an integer"),
    ("cu 2-D", lambda a: a.update(cu_seqlens=torch.tensor([[0, 6]])), ValueError, "cu_seqlens must be 1-D"),
    ("h0 count", lambda a: a.update(cu_seqlens=torch.tensor([0, 2, 6]), initial_state=torch.zeros(1, 4, 8, 4)),
     ValueError, r"initial_state must have shape \[N, HV, K, V\] = \[2, 4, 8, 4\]"),
    ("h0 shape", lambda a: a.update(initial_state=torch.zeros(1, 4, 4, 8)), ValueError, "initial_state must have shape"),
    ("h0 int", lambda a: a.update(initial_state=torch.zeros(1, 4, 8, 4, dtype=torch.int64)), TypeError,
     "initial_state must be a floating"),
    ("chunk", lambda a: a.update(chunk_size=48), ValueError, r"chunk_size=48 is not supported; supported chunk sizes"),
    ("flag", lambda a: a.update(output_final_state=1), TypeError, "output_final_state must be a bool"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_names_the_argument(case):
    _, edit, exc, match = case
    args = _good()
    edit(args)
    with pytest.raises(exc, match=match):
        tk.chunk_gated_delta_rule(**args)


def test_bad_input_fused_recurrent_and_device_mismatch():
    args = _good()
    args["beta"] = args["beta"].to("meta")
    with pytest.raises(ValueError, match="beta is on meta"):
        tk.fused_recurrent_gated_delta_rule(**args)
    args = _good()
    args["cu_seqlens"] = torch.tensor([0, 6], device="meta")
    with pytest.raises(ValueError, match="cu_seqlens is on meta"):
        tk.chunk_gated_delta_rule(**args)
    with pytest.raises(TypeError, match="chunk_size"):
        tk.fused_recurrent_gated_delta_rule(**_good(), chunk_size=64)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strong_decay_underflow_stays_finite(backend):
    """exp(cumulative decay) underflows to 0 inside a chunk; ratios of underflowed decays must not appear."""
    ins, s0 = make_inputs(1, 130, 1, 1, 16, 16, torch.float32, True, True, seed=23)
    ins[3] = torch.full_like(ins[3], -9.0)  # exp(-9 * 64) == 0 in fp32
    do = torch.randn(1, 130, 1, 16, dtype=torch.float64)
    dsT = torch.randn(1, 1, 16, 16, dtype=torch.float64)
    kw = dict(use_qk_l2norm_in_kernel=True, backend=backend)
    compare(run(tk.chunk_gated_delta_rule, ins, s0, do, dsT, **kw), ground_truth(ins, s0, do, dsT, **kw),
            torch.float32, NAMES)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp16_inputs(backend):
    _skip_unsupported(backend, torch.float16)
    ins, s0 = make_inputs(2, 40, 1, 2, 16, 16, torch.float16, True, True, seed=29)
    do = torch.randn(2, 40, 2, 16, dtype=torch.float64)
    dsT = torch.randn(2, 2, 16, 16, dtype=torch.float64)
    kw = dict(use_qk_l2norm_in_kernel=True, backend=backend)
    compare(run(tk.chunk_gated_delta_rule, ins, s0, do, dsT, **kw), ground_truth(ins, s0, do, dsT, **kw),
            torch.float16, NAMES)


def test_initial_state_must_be_a_tensor():
    with pytest.raises(TypeError, match="initial_state must be a torch.Tensor"):
        tk.chunk_gated_delta_rule(**_good(), initial_state=[[0.0]])


@pytest.mark.parametrize("fn", ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"])
@pytest.mark.parametrize("B,T", [(0, 5), (0, 0), (2, 0)])
def test_empty_batch_or_sequence(fn, B, T):
    """B == 0 made the cpu backend hand the kernel one offset (N == 0 sequences), which it refused
    with "cu_seqlens must be a CPU int64 vector" although the reference serves the call."""
    backends = BACKENDS if fn.startswith("chunk") else RECURRENT_BACKENDS
    (q, k, v, g, beta), s0 = make_inputs(B, T, 1, 2, 8, 4, torch.float32, True, True)
    for backend in backends:
        o, sT = getattr(tk, fn)(q, k, v, g, beta, initial_state=s0, output_final_state=True, backend=backend)
        assert o.shape == (B, T, 2, 4) and sT.shape == (B, 2, 8, 4)
        torch.testing.assert_close(sT, s0.float(), atol=0, rtol=0)  # no token: the state is untouched


def _same_non_finite(a, b, name):
    for what, f in (("NaN", torch.isnan), ("+Inf", torch.isposinf), ("-Inf", torch.isneginf)):
        assert torch.equal(f(a), f(b)), f"{name}: {what} at other places than the reference ({int(f(a).sum())} vs {int(f(b).sum())})"
    finite = torch.isfinite(b)
    return a[finite].double(), b[finite].double()


def _non_finite_cases():
    """(name, inputs, l2, reference all finite): a NaN / Inf in one token (g = -Inf is a finite
    state reset), un-normalised large inputs whose state overflows, and large normalised ones."""
    cases = []
    for t, val in (("k", float("nan")), ("v", float("inf")), ("g", -float("inf")), ("q", float("nan")),
                   ("beta", float("inf"))):
        (q, k, v, g, beta), _ = make_inputs(1, 40, 1, 2, 16, 8, torch.bfloat16, False, False, seed=31)
        ins = dict(q=q, k=k, v=v, g=g, beta=beta)
        ins[t][0, 21, 0] = val
        cases.append((f"{t}={val}", ins, False, t == "g"))
    (q, k, v, g, beta), _ = make_inputs(2, 70, 2, 4, 16, 8, torch.bfloat16, False, True, seed=37)
    cases.append(("overflow", dict(q=q * 100, k=k * 100, v=v * 100, g=g, beta=beta), False, False))
    cases.append(("large-l2", dict(q=q * 1e5, k=k * 1e5, v=v * 1e5, g=g, beta=beta), True, True))
    return cases


@pytest.mark.parametrize("case", _non_finite_cases(), ids=lambda c: c[0])
@pytest.mark.parametrize("fn", ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"])
def test_non_finite_values_propagate_as_the_reference(fn, case):
    """The cpu backend gave other NaN/Inf patterns (the chunk form also NaN in tokens before the bad
    one) and, on bf16 inputs whose state overflows, values up to 1e24 away from the reference."""
    _, ins, l2, finite = case
    backends = [b for b in (BACKENDS if fn.startswith("chunk") else RECURRENT_BACKENDS) if b != "triton"]
    want, want_s = gated_delta_rule_reference(**ins, output_final_state=True, use_qk_l2norm_in_kernel=l2)
    assert bool(torch.isfinite(want).all()) == finite  # the case exercises what it is named after
    for backend in backends:
        o, s = getattr(tk, fn)(**ins, output_final_state=True, use_qk_l2norm_in_kernel=l2, backend=backend)
        for a, b, name in ((o, want, "o"), (s, want_s, "final_state")):
            a, b = _same_non_finite(a, b, f"{backend} {name}")
            testing.assert_close(a, b, torch.bfloat16, op=OP, name=f"{backend} {name}")
