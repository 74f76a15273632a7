"""GeGLU: ``swiglu`` / ``swiglu_packed`` with ``activation="gelu"`` (exact) and ``"gelu_tanh"`` on every
available backend, against the float64 reference (fresh random inputs, NaN-poisoned outputs, the
reference forbidden while a fast backend is under test: test_rowwise's harness). The reference
itself is checked against transformers' own activation modules, which is what a patched model
must reproduce. The ``silu`` default is covered by test_rowwise / test_cpu_kernels.
"""
import logging
import math
import types

import pytest
import torch

import twinkle_kernels as tk
from twinkle_kernels import _dispatch, npu
from twinkle_kernels.npu import ops as npu_ops
from twinkle_kernels.moe import moe_experts_reference
from twinkle_kernels.swiglu import swiglu_packed_reference, swiglu_reference
from twinkle_kernels.testing import assert_close

from test_rowwise import BACKENDS, DEVICE, DTYPE_IDS, DTYPES, _check, _leaf, _ReferenceForbidden, _skip_unsupported

GELUS = ("gelu", "gelu_tanh")
backend_p = pytest.mark.parametrize("backend", BACKENDS)
dtype_p = pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: DTYPE_IDS[d])
act_p = pytest.mark.parametrize("activation", GELUS)

# one row, one element, odd widths off every vector width / Triton block, zero rows, leading dims,
# strided layouts, more than one column block
CASES = [((1, 1), "contiguous"), ((1, 33), "contiguous"), ((4, 33), "contiguous"), ((0, 32), "contiguous"),
         ((2, 3, 47), "contiguous"), ((6, 40), "transposed"), ((5, 34), "sliced"), ((3, 1500), "contiguous")]
IDS = [f"{'x'.join(map(str, s))}-{l}" for s, l in CASES]


@act_p
@backend_p
@dtype_p
@pytest.mark.parametrize("shape,layout", CASES, ids=IDS)
def test_geglu_matches_reference(shape, layout, dtype, backend, activation):
    _skip_unsupported(backend, dtype)
    gate = _leaf(shape, dtype, layout, scale=3.0)
    up = _leaf(shape, dtype, "sliced" if layout == "contiguous" else "contiguous")
    _check("swiglu", lambda g, u, a, backend: tk.swiglu(g, u, activation=a, backend=backend), swiglu_reference,
           [("gate",) + gate, ("up",) + up], (activation,), backend, dtype)


@act_p
@backend_p
@dtype_p
@pytest.mark.parametrize("shape,layout", [((4, 66), "contiguous"), ((1, 2), "contiguous"), ((0, 32), "contiguous"),
                                          ((8,), "contiguous"), ((6, 40), "transposed"), ((5, 34), "sliced"),
                                          ((2, 3000), "contiguous")],
                         ids=lambda v: v if isinstance(v, str) else "x".join(map(str, v)))
def test_geglu_packed_matches_reference(shape, layout, dtype, backend, activation):
    _skip_unsupported(backend, dtype)
    x = _leaf(shape, dtype, layout, scale=3.0)
    _check("swiglu_packed", lambda x, a, backend: tk.swiglu_packed(x, activation=a, backend=backend),
           swiglu_packed_reference, [("x",) + x], (activation,), backend, dtype)


def _transformers_act(activation):
    from transformers.activations import ACT2FN
    return ACT2FN[{"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}[activation]]


@pytest.mark.parametrize("activation", ("silu",) + GELUS)
def test_reference_is_transformers_activation_times_up(activation):
    """float64: ``swiglu_reference(g, u, act)`` == transformers' ``ACT2FN[name](g) * u`` (and gelu_tanh ==
    ``gelu_new``, transformers' tanh formula written out in Python)."""
    g = torch.randn(7, 129, dtype=torch.float64) * 4
    u = torch.randn(7, 129, dtype=torch.float64)
    want = _transformers_act(activation)(g) * u
    torch.testing.assert_close(swiglu_reference(g, u, activation), want, atol=1e-12, rtol=1e-12)
    if activation == "gelu_tanh":
        from transformers.activations import ACT2FN
        torch.testing.assert_close(swiglu_reference(g, u, activation), ACT2FN["gelu_new"](g) * u,
                                   atol=1e-12, rtol=1e-12)
    # and the activations differ from each other where it matters (no test that cannot fail)
    if activation != "silu":
        assert (swiglu_reference(g, u, activation) - swiglu_reference(g, u, "silu")).abs().max() > 0.1


@act_p
@backend_p
def test_extreme_gates_stay_finite_and_exact(backend, activation):
    """Saturated gates (|g| up to 100: exp under/overflow inside the kernels) and zeros, fp32."""
    g = torch.tensor([[-100.0, -30.0, -9.0, -5.0, -1e-6, 0.0, 1e-6, 5.0, 9.0, 30.0, 100.0] * 3], device=DEVICE)
    u = torch.randn(g.shape, device=DEVICE)
    gl, ul = g.clone().requires_grad_(), u.clone().requires_grad_()
    with _ReferenceForbidden("swiglu", backend):
        y = tk.swiglu(gl, ul, activation=activation, backend=backend)
        y.backward(torch.ones_like(y))
    gd, ud = g.double().requires_grad_(), u.double().requires_grad_()
    r = swiglu_reference(gd, ud, activation)
    r.backward(torch.ones_like(r))
    assert torch.isfinite(y).all() and torch.isfinite(gl.grad).all() and torch.isfinite(ul.grad).all()
    assert_close(y, r, torch.float32, name=f"y [{backend}]")
    assert_close(gl.grad, gd.grad, torch.float32, name=f"dgate [{backend}]")
    assert_close(ul.grad, ud.grad, torch.float32, name=f"dup [{backend}]")


@act_p
@backend_p
def test_geglu_expanded_output_gradient(backend, activation):
    """``loss = y.sum()`` hands the backward a stride-0 gradient."""
    x = torch.randn(2, 3, 24, device=DEVICE, requires_grad=True)
    g = torch.randn(2, 3, 24, device=DEVICE, requires_grad=True)
    for name, loss, leaves in (
            ("swiglu", lambda b, x, g: tk.swiglu(x, g, activation=activation, backend=b).sum(), (x, g)),
            ("swiglu_packed", lambda b, x: tk.swiglu_packed(x, activation=activation, backend=b).sum(), (x,))):
        got = torch.autograd.grad(loss(backend, *leaves), leaves)
        ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
        want = torch.autograd.grad(loss("reference", *ref_leaves), ref_leaves)
        for i, (a, b) in enumerate(zip(got, want)):
            assert_close(a, b, torch.float32, name=f"{name} grad {i} [{backend}]", scale=4.0)


@pytest.mark.parametrize("bad,exc", [("relu", ValueError), ("GELU", ValueError), ("gelu_pytorch_tanh", ValueError),
                                     (None, TypeError), (1, TypeError)])
def test_bad_activation_names_the_argument(bad, exc):
    x = torch.randn(2, 8, device=DEVICE)
    for call in (lambda: tk.swiglu(x, x, activation=bad), lambda: tk.swiglu_packed(x, activation=bad),
                 lambda: swiglu_reference(x, x, bad)):
        with pytest.raises(exc, match=r"\bactivation\b"):
            call()


def test_activation_is_keyword_only():
    x = torch.randn(2, 8)
    with pytest.raises(TypeError):
        tk.swiglu(x, x, "gelu")  # noqa
    with pytest.raises(TypeError):
        tk.swiglu_packed(x, "gelu")  # noqa


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b in ("reference", "cpu")])
def test_custom_ops_carry_the_activation(backend):
    """The torch.compile path: the custom ops take ``activation`` (opcheck), and their backward ops
    differentiate the GELU, not SiLU."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(4, 33, generator=g).requires_grad_()
    u = torch.randn(4, 33, generator=g).requires_grad_()
    x = torch.randn(2, 3, 34, generator=g).requires_grad_()
    for act in GELUS:
        torch.library.opcheck(torch.ops.twinkle.swiglu.default, (a, u, backend, act))
        torch.library.opcheck(torch.ops.twinkle.swiglu_packed.default, (x, backend, act))
        y = torch.ops.twinkle.swiglu(a, u, backend, act)
        dy = torch.randn_like(y)
        got = torch.autograd.grad(y, (a, u), dy)
        ad, ud = a.detach().double().requires_grad_(), u.detach().double().requires_grad_()
        want = torch.autograd.grad(swiglu_reference(ad, ud, act), (ad, ud), dy.double())
        for gg, ww in zip(got, want):
            assert_close(gg, ww, torch.float32, name=f"twinkle::swiglu backward ({act}, {backend})")


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b in ("reference", "cpu")])
def test_compiled_geglu_matches_eager(backend):
    torch._dynamo.reset()
    gate = torch.randn(3, 40, requires_grad=True)
    up = torch.randn(3, 40, requires_grad=True)

    def f(g, u):
        return tk.swiglu(g, u, activation="gelu_tanh", backend=backend) * 2.0
    y = torch.compile(f, backend="aot_eager", fullgraph=True)(gate, up)
    gd, ud = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
    r = 2.0 * swiglu_reference(gd, ud, "gelu_tanh")
    assert_close(y, r, torch.float32, name="compiled")
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, (gate, up), dy)
    want = torch.autograd.grad(r, (gd, ud), dy.double())
    for a, b in zip(got, want):
        assert_close(a, b, torch.float32, name="compiled grad")


# -- NPU: npu_swiglu is SiLU only ---------------------------------------------------------------

def test_npu_verifier_refuses_gelu_with_its_reason(monkeypatch, caplog):
    """On a (simulated) NPU, silu goes to npu_swiglu; the GELU activations are refused with the
    reason, so automatic selection falls back to the reference (which runs on the NPU tensors)."""
    from npu._sim import simulate_npu            # tests/npu (a package beside this file)
    from npu.emulation import EmulatedTorchNpu
    emu = simulate_npu(monkeypatch, EmulatedTorchNpu())
    x = torch.randn(3, 16)
    npu_dev = types.SimpleNamespace(type="npu")  # torch.device("npu") needs torch_npu
    assert _dispatch.op("swiglu").select(npu_dev, None, x, x, "silu") == "npu"
    for act in GELUS:
        why = _dispatch.op("swiglu").reason("npu", x, x, act)
        assert why == npu_ops.SWIGLU_SILU_ONLY.format(act), why
        assert _dispatch.op("swiglu").select(npu_dev, None, x, x, act) == "reference"
        assert _dispatch.op("swiglu_packed").select(npu_dev, None, x, act) == "reference"
        with pytest.raises(tk.BackendUnavailableError, match="SiLU only"):
            tk.swiglu(x, x, activation=act, backend="npu")
        with pytest.raises(ValueError, match="SiLU only"):   # a direct call never computes silu instead
            npu_ops.swiglu(x, x, act)
    assert not emu.calls, emu.calls     # torch_npu was never asked for a GELU
    # automatic selection on an NPU device: the reference runs, and the log says why once
    monkeypatch.setattr(_dispatch, "_LOGGED", set())
    with caplog.at_level(logging.INFO, logger="twinkle_kernels"):
        for _ in range(3):
            y = _dispatch.op("swiglu")(npu_dev, None, x, x, "gelu_tanh")
    assert_close(y, swiglu_reference(x.double(), x.double(), "gelu_tanh"), torch.float32)
    said = [r.getMessage() for r in caplog.records if "SiLU only" in r.getMessage()]
    assert said == ["twinkle_kernels: swiglu skips backend 'npu': "
                    + npu_ops.SWIGLU_SILU_ONLY.format("gelu_tanh")], caplog.records
    assert not emu.calls, emu.calls
    tk.swiglu(x, x, backend="npu")
    assert [c[0] for c in emu.calls] == ["npu_swiglu"]


@pytest.mark.skipif(npu.unavailable_reason() is not None, reason=f"no Ascend NPU here: {npu.unavailable_reason()}")
@act_p
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_npu_geglu_smoke(activation, dtype):
    """On a real NPU: the GELU activations run (the reference, on the device) and match float64."""
    g, u = torch.randn(16, 512) * 3, torch.randn(16, 512)
    gn = g.to("npu", dtype).requires_grad_()
    un = u.to("npu", dtype).requires_grad_()
    y = tk.swiglu(gn, un, activation=activation)
    y.float().sum().backward()
    gd, ud = g.double().requires_grad_(), u.double().requires_grad_()
    r = swiglu_reference(gd, ud, activation)
    r.sum().backward()
    assert_close(y.cpu(), r, dtype)
    assert_close(gn.grad.cpu(), gd.grad, dtype, name="dgate", scale=4.0)
    assert_close(un.grad.cpu(), ud.grad, dtype, name="dup", scale=4.0)


def test_silu_default_unchanged():
    """The default stays SiLU on every backend (the public signature's default)."""
    g, u = torch.randn(3, 50, device=DEVICE), torch.randn(3, 50, device=DEVICE)
    for b in BACKENDS:
        assert_close(tk.swiglu(g, u, backend=b), swiglu_reference(g.double(), u.double()), torch.float32, name=b)
        assert_close(tk.swiglu(g, u, backend=b), torch.nn.functional.silu(g.double()) * u.double(), torch.float32,
                     name=b)
    assert math.isclose(float(swiglu_reference(torch.tensor([1.0]), torch.tensor([1.0]))), 1 / (1 + math.exp(-1)),
                        rel_tol=1e-6)


# -- moe_experts with GELU experts --------------------------------------------------------------

def _moe_by_token(x, idx, wts, gu, dp, activation):
    """An independent float64 form: one token, one slot at a time (the reference loops over experts)."""
    out = torch.zeros_like(x)
    act = _transformers_act(activation)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            gate, up = (gu[e] @ x[t]).chunk(2)
            out[t] = out[t] + wts[t, j] * (dp[e] @ (act(gate) * up))
    return out


@act_p
def test_moe_reference_is_the_per_token_formula(activation):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 12, generator=g, dtype=torch.float64)
    idx = torch.stack([torch.randperm(5, generator=g)[:2] for _ in range(9)])
    wts = torch.rand(9, 2, generator=g, dtype=torch.float64)
    gu, dp = torch.randn(5, 16, 12, generator=g, dtype=torch.float64), torch.randn(5, 12, 8, generator=g,
                                                                                   dtype=torch.float64)
    got = moe_experts_reference(x, idx, wts, gu, dp, activation)
    torch.testing.assert_close(got, _moe_by_token(x, idx, wts, gu, dp, activation), atol=1e-11, rtol=1e-11)
    assert (got - moe_experts_reference(x, idx, wts, gu, dp)).abs().max() > 1e-2   # not silu


MOE_DTYPES = (torch.float32, torch.bfloat16)


@act_p
@backend_p
@pytest.mark.parametrize("dtype", MOE_DTYPES, ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize("e,k", [(8, 2), (1, 1), (16, 4)])
def test_moe_experts_geglu_matches_reference(e, k, dtype, backend, activation):
    if backend == "triton" and DEVICE.type == "cpu" and dtype != torch.float32:
        pytest.skip("triton interpreter: fp32 only")
    from twinkle_kernels.testing import reduction_scale
    t, h, i = 13, 24, 16
    idx = torch.stack([torch.randperm(e)[:k] for _ in range(t)]).to(DEVICE)
    leaves = [torch.randn(t, h), torch.softmax(torch.randn(t, k), -1), torch.randn(e, 2 * i, h) / math.sqrt(h),
              torch.randn(e, h, i) / math.sqrt(i)]
    fast = [a.to(DEVICE, dtype if n != 1 else torch.float32).detach().requires_grad_() for n, a in enumerate(leaves)]
    ref = [a.to(DEVICE, torch.float64).detach().requires_grad_() for a in leaves]
    with _ReferenceForbidden("moe_experts", backend):
        out = tk.moe_experts(fast[0], idx, *fast[1:], activation=activation, backend=backend)
    want = moe_experts_reference(ref[0], idx, *ref[1:], activation)
    assert_close(out, want, dtype, name=f"out [{backend}]")
    dy = torch.randn(t, h, dtype=torch.float64, device=DEVICE)
    with _ReferenceForbidden("moe_experts", backend):
        out.backward(dy.to(dtype))
    want.backward(dy)
    rows = max(1, int(torch.bincount(idx.reshape(-1), minlength=e).max()))
    for name, a, b, s in zip(("hidden_states", "top_k_weights", "gate_up_proj", "down_proj"), fast, ref,
                             (1.0, reduction_scale(h), reduction_scale(rows), reduction_scale(rows))):
        assert_close(a.grad, b.grad, dtype, name=f"d{name} [{backend}]", scale=s)


def test_moe_experts_bad_activation_names_the_argument():
    x, idx, w = torch.randn(3, 8), torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1)
    gu, dp = torch.randn(2, 8, 8), torch.randn(2, 8, 4)
    with pytest.raises(ValueError, match=r"\bactivation\b"):
        tk.moe_experts(x, idx, w, gu, dp, activation="relu")
    with pytest.raises(TypeError, match=r"\bactivation\b"):
        tk.moe_experts(x, idx, w, gu, dp, activation=None)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b in ("reference", "cpu")])
def test_moe_custom_op_carries_the_activation(backend):
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 4, (5, 2), generator=g)
    args = [torch.randn(5, 16, generator=g).requires_grad_(), idx, torch.rand(5, 2, generator=g).requires_grad_(),
            torch.randn(4, 12, 16, generator=g).requires_grad_(), torch.randn(4, 16, 6, generator=g).requires_grad_()]
    for act in GELUS:
        torch.library.opcheck(torch.ops.twinkle.moe_experts.default, (*args, backend, act))
        y = torch.ops.twinkle.moe_experts(*args, backend, act)
        ref = [a.detach().double().requires_grad_() if a.is_floating_point() else a for a in args]
        want = moe_experts_reference(*ref, act)
        assert_close(y, want, torch.float32, name=f"twinkle::moe_experts ({act})")
        dy = torch.randn_like(y)
        got = torch.autograd.grad(y, [args[0], args[3]], dy)
        exp = torch.autograd.grad(want, [ref[0], ref[3]], dy.double())
        for a, b in zip(got, exp):
            assert_close(a, b, torch.float32, name=f"twinkle::moe_experts backward ({act})", scale=2.0)


@act_p
def test_emulated_npu_moe_experts_geglu(monkeypatch, activation):
    """The npu experts path (npu_grouped_matmul + torch activation) serves GELU: simulated NPU."""
    from npu._sim import simulate_npu
    from npu.emulation import EmulatedTorchNpu
    emu = simulate_npu(monkeypatch, EmulatedTorchNpu())
    torch.manual_seed(0)
    T, H, I, E, k = 9, 16, 12, 5, 2
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    leaves = [torch.randn(T, H), torch.rand(T, k), torch.randn(E, 2 * I, H) * 0.3, torch.randn(E, H, I) * 0.3]
    assert _dispatch.op("moe_experts").select(types.SimpleNamespace(type="npu"), None, leaves[0], idx,
                                              *leaves[1:], activation) == "npu"
    fast = [a.clone().requires_grad_() for a in leaves]
    ref = [a.double().requires_grad_() for a in leaves]
    out = tk.moe_experts(fast[0], idx, *fast[1:], activation=activation, backend="npu")
    want = moe_experts_reference(ref[0], idx, *ref[1:], activation)
    assert_close(out, want, torch.float32, name="out", scale=4.0)
    out.sum().backward()
    want.sum().backward()
    for a, b in zip(fast, ref):
        assert_close(a.grad, b.grad, torch.float32, name="grad", scale=4.0)
    assert "npu_grouped_matmul" in [c[0] for c in emu.calls]


# -- patched models with GELU MLPs / experts ---------------------------------------------------------

PATCH_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "glm4_moe", "deepseek_v3", "qwen3_next",
                  "qwen3_5", "qwen3_5_moe")


def _gelu_model(family, hidden_act):
    import importlib

    from tests.patches.test_patches_models import _CAUSAL_LM, _cfg
    try:
        mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    except ImportError as e:
        pytest.skip(f"{family} is not in this transformers: {e}")
    cfg = _cfg(family)
    cfg.hidden_act = hidden_act
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(mod, _CAUSAL_LM[family])(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _logits_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("hidden_act,op_act", [("gelu", "gelu"), ("gelu_pytorch_tanh", "gelu_tanh")])
@pytest.mark.parametrize("family", PATCH_FAMILIES)
def test_patched_gelu_model_matches_unpatched(family, hidden_act, op_act, monkeypatch):
    """A model with ``hidden_act`` GELU: its MLPs and experts are swapped (not skipped), run the fused
    ops with the matching activation, and give the unpatched logits and parameter gradients."""
    import copy

    import twinkle_patches as tp
    from tests.patches.test_patches_models import batch
    tp.revert()
    model = _gelu_model(family, hidden_act)
    patched = copy.deepcopy(model)
    ids = batch(t=7)
    want_logits, want_grads = _logits_and_grads(model, ids)
    seen = []
    real_swiglu, real_moe = tk.swiglu, tk.moe_experts

    def spy_swiglu(*a, **k):
        seen.append(("swiglu", k.get("activation")))
        return real_swiglu(*a, **k)

    def spy_moe(*a, **k):
        seen.append(("moe_experts", k.get("activation")))
        return real_moe(*a, **k)
    monkeypatch.setattr(tk, "swiglu", spy_swiglu)
    monkeypatch.setattr(tk, "moe_experts", spy_moe)
    report = tp.apply(patched, ops=("swiglu", "experts"))
    try:
        skipped = report.skipped_reasons()
        assert not skipped, skipped
        swapped = {s.spec.op for s in report.swapped}
        assert swapped & {"swiglu", "moe_experts"}, report   # mixtral has experts only
        got_logits, got_grads = _logits_and_grads(patched, ids)
    finally:
        tp.revert(report)
    ops_run = {name for name, _ in seen}
    assert ops_run == swapped & {"swiglu", "moe_experts"}, (ops_run, swapped)
    assert {act for _, act in seen} == {op_act}, seen
    atol, rtol = tk.testing.tolerance(torch.float32, "moe_experts")
    torch.testing.assert_close(got_logits, want_logits, atol=atol, rtol=rtol)
    assert got_grads.keys() == want_grads.keys()
    for n in want_grads:
        torch.testing.assert_close(got_grads[n], want_grads[n], atol=4 * atol, rtol=4 * rtol,
                                   msg=lambda m: f"{family} {n}: {m}")


def test_patch_maps_transformers_activations():
    """Which ``act_fn`` objects the MLP / experts patches serve, and as what; the rest keep their forward."""
    from transformers.activations import ACT2FN

    from twinkle_patches._glu import glu_activation
    served = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_python": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
              "gelu_python_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
    for name in ACT2FN:
        try:
            act = ACT2FN[name]
        except Exception:  # an activation that needs an optional package: not one we serve
            assert name not in served
            continue
        got, why = glu_activation(act)
        assert got == served.get(name), (name, got, why)
        assert (why is None) == (name in served), (name, why)
        if got is not None:   # served ones compute exactly what the op computes (float64)
            x = torch.randn(257, dtype=torch.float64) * 4
            ones = torch.ones_like(x)
            torch.testing.assert_close(swiglu_reference(x, ones, got), act(x), atol=1e-12, rtol=1e-12,
                                       msg=lambda m: f"{name}: {m}")
        else:
            assert type(act).__name__ in why and "does not compute" in why
    for act, want in ((torch.nn.GELU(), "gelu"), (torch.nn.GELU(approximate="tanh"), "gelu_tanh"),
                      (torch.nn.functional.gelu, "gelu"), (torch.nn.SiLU(), "silu"), (torch.nn.ReLU(), None),
                      (torch.nn.Tanh(), None), (None, None)):
        assert glu_activation(act)[0] == want, act


@pytest.fixture
def _dynamo_traces(monkeypatch):
    """dynamo must really trace: a TORCHDYNAMO_DISABLE left by the Megatron CPU mode earlier in the
    session would make a compiled call plain eager (and the op assertions vacuous)."""
    import torch._dynamo
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    with torch._dynamo.config.patch(disable=False):
        yield


@pytest.mark.filterwarnings("ignore")
@pytest.mark.timeout(600)
@pytest.mark.parametrize("under_compile", ["kernels", "auto"])
def test_patched_gelu_model_compiles_fullgraph(under_compile, _dynamo_traces):
    """A GELU (tanh) qwen3_moe model, patched, under torch.compile(fullgraph=True): with the custom ops
    kept ("kernels": the graphs hold twinkle::swiglu and twinkle::moe_experts) and with the default
    decomposition ("auto": the MLP traces the GELU reference), equal to the unpatched eager step."""
    import twinkle_patches as tp
    from test_compile import _assert_step_close, _capture, _fwd_bwd
    from tests.patches.test_patches_models import batch
    tp.revert()
    torch._dynamo.reset()
    model = _gelu_model("qwen3_moe", "gelu_pytorch_tanh")
    ids = batch(t=7)
    want = _fwd_bwd(model, ids)
    report = tp.apply(model, ops=("swiglu", "experts"), under_compile=under_compile)
    try:
        assert {s.spec.op for s in report.swapped} == {"swiglu", "moe_experts"}, report
        seen = set()
        graphs = []
        capture = _capture(seen)

        def backend(gm, example_inputs, **options):
            graphs.append(gm)
            return capture(gm, example_inputs, **options)
        got = _fwd_bwd(torch.compile(model, fullgraph=True, backend=backend), ids)
    finally:
        tp.revert(report)
    assert graphs, "torch.compile traced nothing"
    if under_compile == "kernels":
        assert seen == {"swiglu", "moe_experts"}, seen
    else:
        assert "swiglu" not in seen, seen
    _assert_step_close(got, want)
