"""The C++ CPU kernels against the float64 references, on randomised shapes.

Every case runs the op with ``backend="cpu"`` (so a silent fallback to the reference
would raise instead of passing), compares the forward output and every gradient with
the float64 reference through the one tolerance table (``twinkle_kernels.testing``),
and runs with NaN-poisoned outputs (conftest). Also: the three ISA builds agree, the
weight-gradient reduction is independent of the thread count, and the raw ops reject
malformed calls with a RuntimeError instead of crashing.
"""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import twinkle_kernels as tk
from twinkle_kernels import _cpu_ext
from twinkle_kernels.norm import gated_rms_norm_reference, rms_norm_reference
from twinkle_kernels.rope import apply_rotary_pos_emb_reference
from twinkle_kernels.swiglu import swiglu_packed_reference, swiglu_reference
from twinkle_kernels.testing import assert_close

pytestmark = pytest.mark.skipif(_cpu_ext.unavailable_reason() is not None,
                                reason=f"C++ extension not built: {_cpu_ext.unavailable_reason()}")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

lead_dims = st.lists(st.integers(0, 5), min_size=0, max_size=3)
hidden = st.one_of(st.sampled_from([1, 3, 33, 1000]), st.integers(1, 200))
dtypes = st.sampled_from(DTYPES)
seeds = st.integers(0, 2**31 - 1)


def _run(fn, inputs, grads_out):
    """fn(*inputs) and the grads of every input, given upstream grads (one per output)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(outs, [g.to(o.dtype) for g, o in zip(grads_out, outs)])
    return outs, [t.grad for t in leaves]


def check(op, fast, ref, inputs, dtype, out_shapes, names, scales=None):
    """Compare fast(*inputs) with ref(*float64 inputs), forward and all gradients."""
    grads = [torch.randn(s, dtype=torch.float64).to(dtype) for s in out_shapes]
    outs, gs = _run(fast, inputs, grads)
    r_outs, r_gs = _run(ref, [t.double() for t in inputs], [g.double() for g in grads])
    for i, (o, r) in enumerate(zip(outs, r_outs)):
        assert_close(o, r, dtype, op=op, name=f"{op} output {i}")
    scales = scales or {}
    for name, g, r in zip(names, gs, r_gs):
        assert g is not None, f"{op}: no gradient for {name}"
        assert_close(g, r, dtype, op=op, name=f"{op} grad {name}", scale=scales.get(name, 1.0))


def _rows(shape):
    return math.prod(shape[:-1]) if shape else 1


# -- RMSNorm family ---------------------------------------------------------------------------
@SETTINGS
@given(lead=lead_dims, n=hidden, dtype=dtypes, offset=st.sampled_from([0.0, 1.0]),
       w_lowp=st.booleans(), seed=seeds)
def test_rms_norm_matches_reference(lead, n, dtype, offset, w_lowp, seed):
    torch.manual_seed(seed)
    shape = tuple(lead) + (n,)
    x = torch.randn(shape).to(dtype)
    w = (torch.randn(n) * 0.5 + (0.0 if offset else 1.0)).to(dtype if w_lowp else torch.float32)
    check("rms_norm",
          lambda a, b: tk.rms_norm(a, b, 1e-6, offset=offset, backend="cpu"),
          lambda a, b: rms_norm_reference(a, b, 1e-6, offset),
          [x, w], dtype, [shape], ["x", "weight"], {"weight": math.sqrt(max(1, _rows(shape)))})


@SETTINGS
@given(lead=lead_dims, n=hidden, dtype=dtypes, seed=seeds)
def test_gated_rms_norm_matches_reference(lead, n, dtype, seed):
    torch.manual_seed(seed)
    shape = tuple(lead) + (n,)
    x, g = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    w = torch.randn(n)
    check("gated_rms_norm",
          lambda a, b, c: tk.gated_rms_norm(a, b, c, 1e-6, backend="cpu"),
          lambda a, b, c: gated_rms_norm_reference(a, b, c, 1e-6),
          [x, g, w], dtype, [shape], ["x", "gate", "weight"], {"weight": math.sqrt(max(1, _rows(shape)))})


def test_norms_non_contiguous_input():
    x = torch.randn(40, 6, 2)[:, :, 0].t()  # [6, 40], strided
    w = torch.randn(40)
    check("rms_norm", lambda a, b: tk.rms_norm(a, b, backend="cpu"), rms_norm_reference, [x, w],
          torch.float32, [x.shape], ["x", "weight"], {"weight": 3.0})
    g = torch.randn(40, 6).t()
    check("gated_rms_norm", lambda a, b, c: tk.gated_rms_norm(a, b, c, backend="cpu"), gated_rms_norm_reference,
          [x, g, w], torch.float32, [x.shape], ["x", "gate", "weight"], {"weight": 3.0})


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_weight_grad_independent_of_thread_count(threads):
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        x, w, g = torch.randn(37, 65), torch.randn(65), torch.randn(37, 65)
        check("rms_norm", lambda a, b: tk.rms_norm(a, b, backend="cpu"), rms_norm_reference, [x, w],
              torch.float32, [x.shape], ["x", "weight"], {"weight": math.sqrt(37)})
        check("gated_rms_norm", lambda a, b, c: tk.gated_rms_norm(a, b, c, backend="cpu"), gated_rms_norm_reference,
              [x, g, w], torch.float32, [x.shape], ["x", "gate", "weight"], {"weight": math.sqrt(37)})
    finally:
        torch.set_num_threads(prev)


def test_rms_norm_raw_dw_rows_more_than_threads():
    # dw_partial with more rows than threads: each task owns its row whoever runs it.
    ops = _cpu_ext.ops()
    x, dy, w = torch.randn(50, 20), torch.randn(50, 20), torch.randn(20)
    y, rstd = torch.full_like(x, float("nan")), torch.full((50,), float("nan"))
    ops.rms_norm_fwd(x, w, 1e-6, 0.0, y, rstd)
    for tasks in (1, 5, 64):
        dx, part = torch.full_like(x, float("nan")), torch.zeros(tasks, 20)
        ops.rms_norm_bwd(dy, x, w, rstd, 0.0, dx, part)
        xd = x.double().requires_grad_(True)
        wd = w.double().requires_grad_(True)
        rms_norm_reference(xd, wd, 1e-6).backward(dy.double())
        assert_close(dx, xd.grad, name=f"dx tasks={tasks}")
        assert_close(part.sum(0), wd.grad, name=f"dw tasks={tasks}", scale=math.sqrt(50))


# -- RoPE --------------------------------------------------------------------------------------
@SETTINGS
@given(b=st.integers(1, 2), hq=st.integers(1, 4), hk=st.integers(1, 3), s=st.integers(0, 9),
       half_d=st.integers(1, 40), rot_frac=st.sampled_from([1.0, 0.5, 0.25]),
       layout=st.sampled_from(["bhsd", "bshd", "hsd"]), cos_batch1=st.booleans(), strided=st.booleans(),
       dtype=dtypes, seed=seeds)
def test_rope_matches_reference(b, hq, hk, s, half_d, rot_frac, layout, cos_batch1, strided, dtype, seed):
    torch.manual_seed(seed)
    d = 2 * half_d
    r = max(2, 2 * int(half_d * rot_frac))
    if layout == "hsd":  # no batch dim: cos [S, R], heads first
        qs, ks, cs, ud = (hq, s, d), (hk, s, d), (s, r), 0
    elif layout == "bhsd":
        qs, ks, cs, ud = (b, hq, s, d), (b, hk, s, d), (1 if cos_batch1 else b, s, r), 1
    else:
        qs, ks, cs, ud = (b, s, hq, d), (b, s, hk, d), (1 if cos_batch1 else b, s, r), -2
    q, k = torch.randn(qs).to(dtype), torch.randn(ks).to(dtype)
    if strided:  # the usual HF case: q comes from a transposed projection output
        q = q.transpose(0, 1).contiguous().transpose(0, 1)
        k = torch.randn(ks + (2,)).to(dtype)[..., 0]
    ang = torch.randn(cs[:-1] + (r // 2,))
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(dtype)
    check("apply_rotary_pos_emb",
          lambda a, c: tk.apply_rotary_pos_emb(a, c, cos, sin, ud, backend="cpu"),
          lambda a, c: apply_rotary_pos_emb_reference(a, c, cos.double(), sin.double(), ud),
          [q, k], dtype, [qs, ks], ["q", "k"])


def test_rope_distinct_cos_halves():
    # cos/sin need not repeat their halves: the backward must pair s[h:] with dy[h:] etc.
    q, k = torch.randn(2, 3, 5, 12), torch.randn(2, 1, 5, 12)
    cos, sin = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    check("apply_rotary_pos_emb",
          lambda a, c: tk.apply_rotary_pos_emb(a, c, cos, sin, backend="cpu"),
          lambda a, c: apply_rotary_pos_emb_reference(a, c, cos.double(), sin.double()),
          [q, k], torch.float32, [q.shape, k.shape], ["q", "k"])


def test_rope_q_and_k_with_different_batch_broadcast():
    # k with batch 1 and q with batch 2 under a batch-1 cos: the frames differ, two kernel calls.
    q, k = torch.randn(2, 3, 4, 8), torch.randn(1, 2, 4, 8)
    cos, sin = torch.randn(1, 4, 8), torch.randn(1, 4, 8)
    check("apply_rotary_pos_emb",
          lambda a, c: tk.apply_rotary_pos_emb(a, c, cos, sin, backend="cpu"),
          lambda a, c: apply_rotary_pos_emb_reference(a, c, cos.double(), sin.double()),
          [q, k], torch.float32, [q.shape, k.shape], ["q", "k"])


# -- SwiGLU ------------------------------------------------------------------------------------
ACTIVATIONS = st.sampled_from(["silu", "gelu", "gelu_tanh"])


@SETTINGS
@given(lead=lead_dims, n=hidden, dtype=dtypes, strided=st.booleans(), seed=seeds, act=ACTIVATIONS)
def test_swiglu_matches_reference(lead, n, dtype, strided, seed, act):
    torch.manual_seed(seed)
    shape = tuple(lead) + (n,)
    gate = torch.randn(shape).to(dtype)
    up = torch.randn(shape).to(dtype)
    if strided:
        gate = torch.randn(shape[:-1] + (2 * n,)).to(dtype)[..., ::2]  # non-unit inner stride
        up = torch.randn(shape[:-1] + (n + 3,)).to(dtype)[..., 3:]  # row stride n + 3
    check("swiglu", lambda a, b: tk.swiglu(a, b, activation=act, backend="cpu"),
          lambda a, b: swiglu_reference(a, b, act), [gate, up], dtype, [shape], ["gate", "up"])


@SETTINGS
@given(lead=lead_dims, n=hidden, dtype=dtypes, strided=st.booleans(), seed=seeds, act=ACTIVATIONS)
def test_swiglu_packed_matches_reference(lead, n, dtype, strided, seed, act):
    torch.manual_seed(seed)
    shape = tuple(lead) + (2 * n,)
    x = torch.randn(shape).to(dtype)
    if strided:
        x = torch.randn(shape[:-1] + (2 * n + 5,)).to(dtype)[..., 5:]
    check("swiglu_packed", lambda a: tk.swiglu_packed(a, activation=act, backend="cpu"),
          lambda a: swiglu_packed_reference(a, act), [x], dtype, [shape[:-1] + (n,)], ["x"])


def test_swiglu_long_single_row():
    # One row longer than a column tile: the (row, column-tile) split must cover it all.
    gate, up = torch.randn(1, 20001), torch.randn(1, 20001)
    check("swiglu", lambda a, b: tk.swiglu(a, b, backend="cpu"), swiglu_reference,
          [gate, up], torch.float32, [gate.shape], ["gate", "up"])


# -- the three ISA builds ----------------------------------------------------------------------
def _raw_results(ops, dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 77, generator=g).to(dtype)
    gt = torch.randn(7, 77, generator=g).to(dtype)
    dy = torch.randn(7, 77, generator=g).to(dtype)
    w = torch.randn(77, generator=g)
    res = {}
    y, rstd = torch.empty_like(x), torch.empty(7)
    ops.rms_norm_fwd(x, w, 1e-6, 1.0, y, rstd)
    dx, part = torch.empty_like(x), torch.zeros(2, 77)
    ops.rms_norm_bwd(dy, x, w, rstd, 1.0, dx, part)
    res.update(rms_y=y, rms_dx=dx, rms_dw=part.sum(0))
    y, rstd2 = torch.empty_like(x), torch.empty(7)
    ops.gated_rms_norm_fwd(x, gt, w, 1e-6, y, rstd2)
    dx, dg, part = torch.empty_like(x), torch.empty_like(x), torch.zeros(2, 77)
    ops.gated_rms_norm_bwd(dy, x, gt, w, rstd2, dx, dg, part)
    res.update(gated_y=y, gated_dx=dx, gated_dg=dg, gated_dw=part.sum(0))
    y, du, dg = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)
    ops.swiglu_fwd(x, gt, y)
    ops.swiglu_bwd(dy, x, gt, dg, du)
    res.update(swiglu_y=y, swiglu_dg=dg, swiglu_du=du)
    for act in (1, 2):  # exact GELU, tanh GELU (erfc / exp differ per ISA)
        y, du, dg = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)
        ops.swiglu_fwd(x, gt, y, act)
        ops.swiglu_bwd(dy, x, gt, dg, du, act)
        res.update({f"geglu{act}_y": y, f"geglu{act}_dg": dg, f"geglu{act}_du": du})
    q = torch.randn(2, 3, 5, 70, generator=g).to(dtype)
    k = torch.randn(2, 1, 5, 70, generator=g).to(dtype)
    cos, sin = torch.randn(2, 5, 66, generator=g), torch.randn(2, 5, 66, generator=g)
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    ops.rope_fwd(q, k, cos, sin, qo, ko)
    gq, gk = torch.empty_like(q), torch.empty_like(k)
    ops.rope_bwd(q, k, cos, sin, gq, gk)
    res.update(rope_q=qo, rope_k=ko, rope_dq=gq, rope_dk=gk)
    return res


@pytest.mark.parametrize("dtype", DTYPES)
def test_isa_builds_agree(dtype):
    variants, missing = [], []
    for v in _cpu_ext.cpu_supports():
        try:
            variants.append((v, _cpu_ext.load(v)))
        except ImportError:
            missing.append(v)
    if len(variants) < 2:
        pytest.skip(f"fewer than two ISA builds here (missing {missing}); build all with "
                    "`python setup.py build_ext --inplace`")
    base_name, base = variants[0]
    expected = _raw_results(base, dtype)
    for v, ops in variants[1:]:
        got = _raw_results(ops, dtype)
        for key, val in expected.items():
            # Vector widths differ, so summation order and exp() do: equal within the dtype's tolerance.
            assert_close(got[key], val.double(), dtype, name=f"{key}: {v} vs {base_name}", scale=4.0)


# -- malformed raw calls -----------------------------------------------------------------------
def _bad_calls():
    ops = _cpu_ext.ops()
    x, w = torch.randn(4, 8), torch.randn(8)
    y, rstd = torch.empty(4, 8), torch.empty(4)
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 8)
    cos = torch.randn(1, 3, 8)
    return {
        "rms_fwd weight size": lambda: ops.rms_norm_fwd(x, torch.randn(7), 1e-6, 0.0, y, rstd),
        "rms_fwd out shape": lambda: ops.rms_norm_fwd(x, w, 1e-6, 0.0, torch.empty(4, 9), rstd),
        "rms_fwd non-contiguous": lambda: ops.rms_norm_fwd(x.t(), torch.randn(4), 1e-6, 0.0, y.t(), rstd),
        "rms_fwd float64": lambda: ops.rms_norm_fwd(x.double(), w, 1e-6, 0.0, y.double(), rstd),
        "rms_fwd rstd size": lambda: ops.rms_norm_fwd(x, w, 1e-6, 0.0, y, torch.empty(3)),
        "rms_bwd dy shape": lambda: ops.rms_norm_bwd(torch.randn(4, 7), x, w, rstd, 0.0, y, torch.zeros(2, 8)),
        "rms_bwd dw_partial": lambda: ops.rms_norm_bwd(x, x, w, rstd, 0.0, y, torch.zeros(2, 9)),
        "gated_fwd gate shape": lambda: ops.gated_rms_norm_fwd(x, torch.randn(4, 7), w, 1e-6, y, rstd),
        "gated_fwd weight dtype": lambda: ops.gated_rms_norm_fwd(x, x, w.half(), 1e-6, y, rstd),
        "gated_bwd dg shape": lambda: ops.gated_rms_norm_bwd(x, x, x, w, rstd, y, torch.empty(3, 8),
                                                             torch.zeros(2, 8)),
        "rope k batch": lambda: ops.rope_fwd(q, torch.randn(2, 1, 3, 8), cos, cos, torch.empty_like(q),
                                             torch.empty(2, 1, 3, 8)),
        "rope cos shape": lambda: ops.rope_fwd(q, k, torch.randn(1, 4, 8), torch.randn(1, 4, 8),
                                               torch.empty_like(q), torch.empty_like(k)),
        "rope odd rotary": lambda: ops.rope_fwd(q, k, torch.randn(1, 3, 7), torch.randn(1, 3, 7),
                                                torch.empty_like(q), torch.empty_like(k)),
        "rope rotary > head": lambda: ops.rope_fwd(q, k, torch.randn(1, 3, 10), torch.randn(1, 3, 10),
                                                   torch.empty_like(q), torch.empty_like(k)),
        "rope 3-D q": lambda: ops.rope_fwd(q[0], k, cos, cos, torch.empty_like(q[0]), torch.empty_like(k)),
        "rope fp16 cos": lambda: ops.rope_fwd(q, k, cos.half(), cos.half(), torch.empty_like(q),
                                              torch.empty_like(k)),
        "swiglu up shape": lambda: ops.swiglu_fwd(x, torch.randn(4, 7), y),
        "swiglu out dtype": lambda: ops.swiglu_fwd(x, x, torch.empty(4, 8, dtype=torch.bfloat16)),
        "swiglu strided cols": lambda: ops.swiglu_fwd(x, torch.randn(4, 16)[:, ::2], y),
        "swiglu act code": lambda: ops.swiglu_fwd(x, x, y, 3),
        "swiglu_bwd act code": lambda: ops.swiglu_bwd(x, x, x, y, torch.empty(4, 8), -1),
        "swiglu_bwd du shape": lambda: ops.swiglu_bwd(x, x, x, y, torch.empty(4, 4)),
    }


@pytest.mark.parametrize("case", sorted(_bad_calls().keys()) if _cpu_ext.unavailable_reason() is None else [])
def test_raw_ops_reject_bad_calls(case):
    with pytest.raises(RuntimeError):
        _bad_calls()[case]()


def test_zero_rows_everywhere():
    for dtype in DTYPES:
        x = torch.randn(0, 3, 16).to(dtype)
        check("rms_norm", lambda a, b: tk.rms_norm(a, b, backend="cpu"), rms_norm_reference,
              [x, torch.randn(16)], dtype, [x.shape], ["x", "weight"])
        check("swiglu_packed", lambda a: tk.swiglu_packed(a, backend="cpu"), swiglu_packed_reference,
              [x], dtype, [(0, 3, 8)], ["x"])


@pytest.mark.parametrize("backend", ["cpu", None], ids=["explicit", "auto"])
def test_empty_last_dim_strided_inputs(backend):
    """An empty tensor with a strided last dim: contiguous() keeps its strides (torch calls any empty
    tensor contiguous), and the kernels' layout checks raised "must have unit stride" for a call with
    nothing to read."""
    for dtype in DTYPES:
        x = torch.randn(0, 64).to(dtype)[:, ::2]  # [0, 32], strides (64, 2)
        assert x.contiguous().stride() == (64, 2)
        check("swiglu", lambda a, b: tk.swiglu(a, b, backend=backend), swiglu_reference, [x, x], dtype,
              [x.shape], ["gate", "up"])
        check("swiglu_packed", lambda a: tk.swiglu_packed(a, backend=backend), swiglu_packed_reference,
              [x], dtype, [(0, 16)], ["x"])
        q = torch.randn(2, 0, 5, 32).to(dtype)[..., ::2]                           # no q heads
        k = torch.randn(2, 3, 5, 16).to(dtype)
        cos, sin = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
        check("apply_rotary_pos_emb", lambda a, b: tk.apply_rotary_pos_emb(a, b, cos, sin, backend=backend),
              lambda a, b: apply_rotary_pos_emb_reference(a, b, cos.to(a.dtype), sin.to(a.dtype)),
              [q, k], dtype, [q.shape, k.shape], ["q", "k"])
        q0, c0 = torch.randn(2, 3, 0, 32).to(dtype)[..., ::2], torch.randn(2, 0, 32)[..., ::2]  # no positions
        check("apply_rotary_pos_emb", lambda a, b: tk.apply_rotary_pos_emb(a, b, c0, c0, backend=backend),
              lambda a, b: apply_rotary_pos_emb_reference(a, b, c0.to(a.dtype), c0.to(a.dtype)),
              [q0, q0], dtype, [q0.shape, q0.shape], ["q", "k"])


def test_extension_directory_hook(tmp_path):
    """TWINKLE_CPU_EXT_DIR (the sanitizer lane's hook) loads the builds from that directory, read at
    load time, and a directory without the build leaves the backend unavailable, saying why."""
    import os
    import subprocess
    import sys
    probe = ("from twinkle_kernels import _cpu_ext; print(_cpu_ext.loaded_from()); "
             "print(_cpu_ext.unavailable_reason())")
    pkg = os.path.dirname(os.path.abspath(_cpu_ext.__file__))
    env = dict(os.environ, TWINKLE_CPU_ISA=_cpu_ext.chosen_variant())
    for ext_dir, expect in ((pkg, pkg), (str(tmp_path), None)):
        env["TWINKLE_CPU_EXT_DIR"] = ext_dir
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        where, why = out.stdout.splitlines()
        if expect:
            assert os.path.dirname(where) == expect and why == "None"
        else:
            assert where == "None" and f"TWINKLE_CPU_EXT_DIR={tmp_path}: no _C_" in why
