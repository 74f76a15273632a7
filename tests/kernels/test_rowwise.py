"""Row-wise ops (RMSNorm family, rotary embedding, SwiGLU) on every available backend.

Each case compares the forward and every gradient with the float64 reference on fresh
random inputs, with fast-path outputs NaN-poisoned (conftest). While a fast backend is
under test the reference implementation is made to raise, so a case cannot pass by
quietly running the reference. The device is CUDA when present, else the CPU (Triton
then runs in its interpreter, in fp32 only: its bf16/fp16 arithmetic is wrong, docs/design.md).
"""
import math
import os
import re

import pytest
import torch

import twinkle_kernels as tk
from twinkle_kernels import _dispatch
from twinkle_kernels.norm import gated_rms_norm_reference, rms_norm_reference
from twinkle_kernels.rope import apply_rotary_pos_emb_reference
from twinkle_kernels.swiglu import swiglu_packed_reference, swiglu_reference
from twinkle_kernels.testing import assert_close

from conftest import available_backends

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# the C++ backend only serves CPU tensors
BACKENDS = [b for b in available_backends() if not (b == "cpu" and DEVICE.type != "cpu")]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _interpreted() -> bool:
    return DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _skip_unsupported(backend, dtype):
    if backend == "triton" and dtype != torch.float32 and _interpreted():
        pytest.skip("Triton interpreter: bf16/fp16 arithmetic is wrong there (docs/design.md); covered on a GPU")


def _leaf(shape, dtype, layout="contiguous", scale=1.0, grad=True):
    """A random leaf tensor and the view of it the op receives (``layout`` makes it non-contiguous)."""
    shape = tuple(shape)
    if layout == "contiguous":
        base = torch.randn(shape, device=DEVICE) * scale
        view = lambda t: t  # noqa: E731
    elif layout == "transposed":  # last dim strided
        base = torch.randn(shape[:-2] + (shape[-1], shape[-2]), device=DEVICE) * scale
        view = lambda t: t.transpose(-1, -2)  # noqa: E731
    elif layout == "sliced":  # row stride != last dim, storage offset != 0
        n = shape[-1]
        base = torch.randn(shape[:-1] + (2 * n + 1,), device=DEVICE) * scale
        view = lambda t: t[..., 1:n + 1]  # noqa: E731
    else:
        raise AssertionError(layout)
    base = base.to(dtype).requires_grad_(grad)
    return base, view


class _ReferenceForbidden:
    """Inside the block, the op's reference implementation raises (fast backends only)."""

    def __init__(self, name, backend):
        self.impl = _dispatch.op(name).impls["reference"]
        self.active = backend != "reference"

    def __enter__(self):
        self.fn = self.impl.fn
        if self.active:
            def boom(*a, **k):
                raise AssertionError("the reference ran while a fast backend was under test")
            self.impl.fn = boom

    def __exit__(self, *exc):
        self.impl.fn = self.fn


def _check(name, fn, ref, leaves, extra, backend, dtype, dweight_rows=None):
    """Run ``fn(*views, *extra, backend=backend)`` and ``ref`` in float64; compare outputs and grads.

    leaves: ``[(arg_name, leaf, view_fn)]``. ``dweight_rows`` maps an argument name to the
    number of rows its gradient sums over (the tolerance grows with its square root).
    """
    views = [v(b) for _, b, v in leaves]
    assert _dispatch.op(name).select(DEVICE, backend, *views, *extra) == backend
    with _ReferenceForbidden(name, backend):
        out = fn(*views, *extra, backend=backend)
    outs = out if isinstance(out, tuple) else (out,)

    ref_leaves = [b.detach().double().requires_grad_(b.requires_grad) for _, b, _ in leaves]
    ref_out = ref(*[v(rb) for (_, _, v), rb in zip(leaves, ref_leaves)], *extra)
    ref_outs = ref_out if isinstance(ref_out, tuple) else (ref_out,)

    for i, (o, r) in enumerate(zip(outs, ref_outs)):
        assert o.dtype == views[0].dtype and o.device == DEVICE
        assert_close(o, r, dtype, op=name, name=f"{name} output {i} [{backend}]")

    dys = [torch.randn(o.shape, device=DEVICE).to(o.dtype) for o in outs]
    with _ReferenceForbidden(name, backend):
        torch.autograd.backward(outs, dys)
    torch.autograd.backward(ref_outs, [d.double() for d in dys])
    for (arg, b, _), rb in zip(leaves, ref_leaves):
        if not b.requires_grad:
            continue
        assert b.grad is not None, f"no gradient for {arg}"
        rows = (dweight_rows or {}).get(arg)
        scale = math.sqrt(max(rows, 1)) if rows is not None else 1.0
        assert_close(b.grad, rb.grad, b.dtype, op=name, name=f"d{arg} [{backend}]", scale=scale)


def _rows_of(shape):
    return math.prod(shape[:-1])


backend_p = pytest.mark.parametrize("backend", BACKENDS)
dtype_p = pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: DTYPE_IDS[d])

# (shape, layout): hidden sizes off the power-of-two grid, one row, zero rows, leading dims.
NORM_CASES = [
    ((4, 33), "contiguous"),
    ((1, 1), "contiguous"),
    ((3, 3), "contiguous"),
    ((7,), "contiguous"),
    ((2, 5, 200), "contiguous"),
    ((0, 64), "contiguous"),
    ((64, 256), "contiguous"),
    ((50, 200), "contiguous"),  # backward programs walk several row tiles, the last one ragged
    ((6, 40), "transposed"),
    ((2, 3, 33), "sliced"),
]
NORM_IDS = [f"{'x'.join(map(str, s))}-{l}" for s, l in NORM_CASES]


# --- RMSNorm ----------------------------------------------------------------------------------

def _rms(x, w, eps, offset, backend):
    return tk.rms_norm(x, w, eps, offset=offset, backend=backend)


@backend_p
@dtype_p
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("shape,layout", NORM_CASES, ids=NORM_IDS)
def test_rms_norm(shape, layout, offset, dtype, backend):
    _skip_unsupported(backend, dtype)
    x = _leaf(shape, dtype, layout, scale=2.0)
    # zero-centred weights are small (initialised at 0), plain ones around 1
    w = _leaf(shape[-1:], dtype, scale=0.1 if offset else 1.0)
    _check("rms_norm", _rms, rms_norm_reference, [("x",) + x, ("weight",) + w], (1e-6, offset), backend, dtype,
           dweight_rows={"weight": _rows_of(shape)})


@backend_p
@dtype_p
def test_rms_norm_weight_dtype_differs_from_x(dtype, backend):
    """Mixed precision: bf16/fp16 activations with fp32 weights (fp32 x gets a bf16 weight)."""
    _skip_unsupported(backend, dtype)
    wdtype = torch.bfloat16 if dtype == torch.float32 else torch.float32
    x = _leaf((5, 48), dtype)
    w = _leaf((48,), wdtype)
    _check("rms_norm", _rms, rms_norm_reference, [("x",) + x, ("weight",) + w], (1e-5, 0.0),
           backend, dtype, dweight_rows={"weight": 5})
    assert x[0].grad.dtype == dtype and w[0].grad.dtype == wdtype


@backend_p
def test_rms_norm_only_weight_requires_grad(backend):
    x = _leaf((9, 20), torch.float32, grad=False)
    w = _leaf((20,), torch.float32)
    _check("rms_norm", _rms, rms_norm_reference, [("x",) + x, ("weight",) + w], (1e-6, 0.0),
           backend, torch.float32, dweight_rows={"weight": 9})


@backend_p
@dtype_p
@pytest.mark.parametrize("shape,layout", NORM_CASES, ids=NORM_IDS)
def test_gated_rms_norm(shape, layout, dtype, backend):
    _skip_unsupported(backend, dtype)
    x = _leaf(shape, dtype, layout, scale=2.0)
    gate = _leaf(shape, dtype, "sliced" if layout == "transposed" else layout, scale=3.0)
    w = _leaf(shape[-1:], dtype)
    _check("gated_rms_norm", lambda x, g, w, eps, backend: tk.gated_rms_norm(x, g, w, eps, backend=backend),
           gated_rms_norm_reference, [("x",) + x, ("gate",) + gate, ("weight",) + w], (1e-6,), backend, dtype,
           dweight_rows={"weight": _rows_of(shape)})


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])
def test_norm_weight_gradient_is_deterministic(backend):
    x = torch.randn(64, 96, device=DEVICE)
    g = torch.randn(64, 96, device=DEVICE)
    dy = torch.randn(64, 96, device=DEVICE)
    grads = []
    for _ in range(2):
        w = torch.full((96,), 0.5, device=DEVICE, requires_grad=True)
        tk.gated_rms_norm(x, g, w, backend=backend).backward(dy)
        grads.append(w.grad)
    assert torch.equal(grads[0], grads[1])


# --- rotary embedding -------------------------------------------------------------------------

# (B, Hq, Hk, S, D, R, unsqueeze_dim, layout, cos batch)
ROPE_CASES = [
    (2, 4, 2, 5, 16, 16, 1, "contiguous", 2),   # full rotary, GQA
    (2, 4, 1, 5, 16, 16, 2, "contiguous", 2),   # [B, S, H, D]
    (2, 4, 2, 3, 24, 8, 1, "contiguous", 1),    # partial rotary, cos shared over the batch
    (1, 3, 3, 7, 10, 6, 2, "contiguous", 1),    # partial, half = 3, head dim not a power of two
    (2, 4, 2, 6, 16, 16, 1, "hf", 1),           # HF: view(B, S, H, D).transpose(1, 2)
    (2, 3, 1, 4, 20, 12, 1, "hf", 2),           # HF layout, partial
    (1, 2, 1, 1, 8, 8, 2, "contiguous", 1),     # one position
    (0, 2, 1, 4, 8, 8, 1, "contiguous", 1),     # empty batch
    (2, 16, 4, 16, 64, 32, 1, "contiguous", 2), # larger
]
ROPE_IDS = [f"B{c[0]}-Hq{c[1]}-Hk{c[2]}-S{c[3]}-D{c[4]}-R{c[5]}-ud{c[6]}-{c[7]}-cb{c[8]}" for c in ROPE_CASES]


def _qk_leaf(B, H, S, D, ud, layout, dtype):
    if layout == "hf":
        assert ud == 1
        base = torch.randn(B, S, H, D, device=DEVICE).to(dtype).requires_grad_()
        return base, lambda t: t.transpose(1, 2)
    shape = (B, H, S, D) if ud == 1 else (B, S, H, D)
    return _leaf(shape, dtype)


@backend_p
@dtype_p
@pytest.mark.parametrize("B,Hq,Hk,S,D,R,ud,layout,cb", ROPE_CASES, ids=ROPE_IDS)
def test_apply_rotary_pos_emb(B, Hq, Hk, S, D, R, ud, layout, cb, dtype, backend):
    _skip_unsupported(backend, dtype)
    q = _qk_leaf(B, Hq, S, D, ud, layout, dtype)
    k = _qk_leaf(B, Hk, S, D, ud, layout, dtype)
    # independent random cos / sin (not a real rotation) so that mixing up halves is caught
    cos = torch.randn(min(cb, B) if B else 0, S, R, device=DEVICE).to(dtype)
    sin = torch.randn(cos.shape, device=DEVICE).to(dtype)
    ident = lambda t: t  # noqa: E731
    _check("apply_rotary_pos_emb",
           lambda q, k, c, s, ud, backend: tk.apply_rotary_pos_emb(q, k, c, s, ud, backend=backend),
           lambda q, k, c, s, ud: apply_rotary_pos_emb_reference(q, k, c.double(), s.double(), ud),
           [("q",) + q, ("k",) + k, ("cos", cos, ident), ("sin", sin, ident)], (ud,), backend, dtype)


@backend_p
def test_apply_rotary_pos_emb_negative_unsqueeze_dim(backend):
    q, k = torch.randn(2, 5, 3, 8, device=DEVICE), torch.randn(2, 5, 1, 8, device=DEVICE)
    cos, sin = torch.randn(2, 5, 8, device=DEVICE), torch.randn(2, 5, 8, device=DEVICE)
    got = tk.apply_rotary_pos_emb(q, k, cos, sin, -2, backend=backend)
    want = apply_rotary_pos_emb_reference(q.double(), k.double(), cos.double(), sin.double(), 2)
    for g, w in zip(got, want):
        assert_close(g, w, torch.float32, name="rope ud=-2")


def test_apply_rotary_pos_emb_cos_grad_goes_to_reference():
    q, k = torch.randn(1, 2, 3, 8, device=DEVICE), torch.randn(1, 2, 3, 8, device=DEVICE)
    cos = torch.randn(1, 3, 8, device=DEVICE, requires_grad=True)
    sin = torch.randn(1, 3, 8, device=DEVICE)
    assert _dispatch.op("apply_rotary_pos_emb").select(DEVICE, None, q, k, cos, sin, 1) == "reference"
    qe, _ = tk.apply_rotary_pos_emb(q, k, cos, sin)
    qe.sum().backward()
    assert cos.grad is not None and torch.isfinite(cos.grad).all()


# --- SwiGLU -----------------------------------------------------------------------------------

SWIGLU_CASES = NORM_CASES + [((3, 1500), "contiguous")]  # > one column block
SWIGLU_IDS = [f"{'x'.join(map(str, s))}-{l}" for s, l in SWIGLU_CASES]


@backend_p
@dtype_p
@pytest.mark.parametrize("shape,layout", SWIGLU_CASES, ids=SWIGLU_IDS)
def test_swiglu(shape, layout, dtype, backend):
    _skip_unsupported(backend, dtype)
    gate = _leaf(shape, dtype, layout, scale=3.0)
    up = _leaf(shape, dtype, "sliced" if layout == "contiguous" else "contiguous")
    _check("swiglu", lambda g, u, backend: tk.swiglu(g, u, backend=backend), swiglu_reference,
           [("gate",) + gate, ("up",) + up], (), backend, dtype)


@backend_p
@dtype_p
@pytest.mark.parametrize("shape,layout", [((4, 66), "contiguous"), ((1, 2), "contiguous"), ((2, 3, 400), "contiguous"),
                                          ((0, 32), "contiguous"), ((8,), "contiguous"), ((6, 40), "transposed"),
                                          ((5, 34), "sliced"), ((2, 3000), "contiguous")],
                         ids=lambda v: v if isinstance(v, str) else "x".join(map(str, v)))
def test_swiglu_packed(shape, layout, dtype, backend):
    _skip_unsupported(backend, dtype)
    x = _leaf(shape, dtype, layout, scale=3.0)
    _check("swiglu_packed", lambda x, backend: tk.swiglu_packed(x, backend=backend), swiglu_packed_reference,
           [("x",) + x], (), backend, dtype)


@backend_p
def test_backward_of_a_sum_with_expanded_gradients(backend):
    """``loss = y.sum()`` hands the backward a stride-0 (expanded) gradient."""
    x = torch.randn(2, 3, 24, device=DEVICE, requires_grad=True)
    g = torch.randn(2, 3, 24, device=DEVICE, requires_grad=True)
    w = torch.randn(24, device=DEVICE, requires_grad=True)
    q = torch.randn(2, 3, 4, 24, device=DEVICE, requires_grad=True)
    k = torch.randn(2, 3, 2, 24, device=DEVICE, requires_grad=True)
    c, s = torch.randn(2, 3, 16, device=DEVICE), torch.randn(2, 3, 16, device=DEVICE)
    calls = [
        ("rms_norm", lambda b, x, w: tk.rms_norm(x, w, offset=1.0, backend=b).sum(), (x, w)),
        ("gated_rms_norm", lambda b, x, g, w: tk.gated_rms_norm(x, g, w, backend=b).sum(), (x, g, w)),
        ("apply_rotary_pos_emb",
         lambda b, q, k: sum(t.sum() for t in tk.apply_rotary_pos_emb(q, k, c.to(q.dtype), s.to(q.dtype), 2,
                                                                        backend=b)), (q, k)),
        ("swiglu", lambda b, x, g: tk.swiglu(x, g, backend=b).sum(), (x, g)),
        ("swiglu_packed", lambda b, x: tk.swiglu_packed(x, backend=b).sum(), (x,)),
    ]
    for name, loss, leaves in calls:
        got = torch.autograd.grad(loss(backend, *leaves), leaves)
        ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
        want = torch.autograd.grad(loss("reference", *ref_leaves), ref_leaves)
        for i, (a, b) in enumerate(zip(got, want)):
            assert_close(a, b, torch.float32, op=name, name=f"{name} grad {i} [{backend}]", scale=4.0)


# --- selection --------------------------------------------------------------------------------

def _expected_default():
    if DEVICE.type == "cuda":
        return "triton" if "triton" in BACKENDS else "reference"
    return "cpu" if "cpu" in BACKENDS else "reference"


def test_auto_selection_picks_the_device_default(monkeypatch):
    monkeypatch.delenv(_dispatch.ENV_VAR, raising=False)
    x, g, w = (torch.randn(3, 8, device=DEVICE), torch.randn(3, 8, device=DEVICE), torch.randn(8, device=DEVICE))
    q, k = torch.randn(1, 2, 3, 8, device=DEVICE), torch.randn(1, 1, 3, 8, device=DEVICE)
    c, s = torch.randn(1, 3, 8, device=DEVICE), torch.randn(1, 3, 8, device=DEVICE)
    calls = {
        "rms_norm": (x, w, 1e-6, 0.0),
        "gated_rms_norm": (x, g, w, 1e-6),
        "apply_rotary_pos_emb": (q, k, c, s, 1),
        "swiglu": (x, g),
        "swiglu_packed": (x,),
    }
    for name, args in calls.items():
        assert _dispatch.op(name).select(DEVICE, None, *args) == _expected_default(), name


@pytest.mark.skipif("triton" not in BACKENDS, reason="triton is not usable here")
def test_explicit_triton_rejects_float64():
    x = torch.randn(2, 8, dtype=torch.float64, device=DEVICE)
    with pytest.raises(tk.BackendUnavailableError, match="triton.*float64"):
        tk.swiglu(x, x, backend="triton")


# --- bad inputs -------------------------------------------------------------------------------

def _t(*shape, dtype=torch.float32, device=None):
    return torch.randn(shape, device=device or DEVICE).to(dtype)


META = torch.device("meta")
BAD_CALLS = [
    # (id, call, exception, the argument the message must name)
    ("rms-weight-shape", lambda: tk.rms_norm(_t(2, 8), _t(7)), ValueError, "weight"),
    ("rms-weight-2d", lambda: tk.rms_norm(_t(2, 8), _t(1, 8)), ValueError, "weight"),
    ("rms-x-int", lambda: tk.rms_norm(torch.ones(2, 8, dtype=torch.int32, device=DEVICE), _t(8)), TypeError, "x"),
    ("rms-weight-int", lambda: tk.rms_norm(_t(2, 8), torch.ones(8, dtype=torch.int64, device=DEVICE)), TypeError,
     "weight"),
    ("rms-x-0d", lambda: tk.rms_norm(_t(), _t(1)), ValueError, "x"),
    ("rms-x-list", lambda: tk.rms_norm([[1.0, 2.0]], _t(2)), TypeError, "x"),
    ("rms-weight-meta", lambda: tk.rms_norm(_t(2, 8), _t(8, device=META)), ValueError, "weight"),
    ("rms-eps-zero", lambda: tk.rms_norm(_t(2, 8), _t(8), 0.0), ValueError, "eps"),
    ("rms-eps-negative", lambda: tk.rms_norm(_t(2, 8), _t(8), -1e-6), ValueError, "eps"),
    ("rms-eps-nan", lambda: tk.rms_norm(_t(2, 8), _t(8), float("nan")), ValueError, "eps"),
    ("rms-eps-str", lambda: tk.rms_norm(_t(2, 8), _t(8), "1e-6"), TypeError, "eps"),
    ("rms-offset-inf", lambda: tk.rms_norm(_t(2, 8), _t(8), offset=float("inf")), ValueError, "offset"),
    ("gated-gate-shape", lambda: tk.gated_rms_norm(_t(2, 8), _t(3, 8), _t(8)), ValueError, "gate"),
    ("gated-gate-dtype", lambda: tk.gated_rms_norm(_t(2, 8), _t(2, 8, dtype=torch.float16), _t(8)), TypeError,
     "gate"),
    ("gated-gate-int", lambda: tk.gated_rms_norm(_t(2, 8), torch.ones(2, 8, dtype=torch.int32, device=DEVICE), _t(8)),
     TypeError, "gate"),
    ("gated-gate-meta", lambda: tk.gated_rms_norm(_t(2, 8), _t(2, 8, device=META), _t(8)), ValueError, "gate"),
    ("gated-eps", lambda: tk.gated_rms_norm(_t(2, 8), _t(2, 8), _t(8), -1.0), ValueError, "eps"),
    ("rope-head-dim", lambda: tk.apply_rotary_pos_emb(_t(1, 2, 3, 8), _t(1, 2, 3, 6), _t(1, 3, 6), _t(1, 3, 6)),
     ValueError, "k"),
    ("rope-rot-odd", lambda: tk.apply_rotary_pos_emb(_t(1, 2, 3, 8), _t(1, 2, 3, 8), _t(1, 3, 5), _t(1, 3, 5)),
     ValueError, "cos"),
    ("rope-rot-too-big", lambda: tk.apply_rotary_pos_emb(_t(1, 2, 3, 8), _t(1, 2, 3, 8), _t(1, 3, 10), _t(1, 3, 10)),
     ValueError, "cos"),
    ("rope-sin-shape", lambda: tk.apply_rotary_pos_emb(_t(1, 2, 3, 8), _t(1, 2, 3, 8), _t(1, 3, 8), _t(1, 3, 6)),
     ValueError, "sin"),
    ("rope-q-int", lambda: tk.apply_rotary_pos_emb(torch.ones(1, 2, 3, 8, dtype=torch.int32, device=DEVICE),
                                                   _t(1, 2, 3, 8), _t(1, 3, 8), _t(1, 3, 8)), TypeError, "q"),
    ("rope-k-dtype", lambda: tk.apply_rotary_pos_emb(_t(1, 2, 3, 8), _t(1, 2, 3, 8, dtype=torch.float16),
                                                     _t(1, 3, 8), _t(1, 3, 8)), TypeError, "k"),
    ("rope-k-meta", lambda: tk.apply_rotary_pos_emb(_t(1, 2, 3, 8), _t(1, 2, 3, 8, device=META),
                                                    _t(1, 3, 8), _t(1, 3, 8)), ValueError, "k"),
    ("rope-seq-mismatch", lambda: tk.apply_rotary_pos_emb(_t(1, 2, 3, 8), _t(1, 2, 3, 8), _t(1, 4, 8), _t(1, 4, 8)),
     ValueError, "cos"),
    ("rope-unsqueeze-range", lambda: tk.apply_rotary_pos_emb(_t(1, 2, 3, 8), _t(1, 2, 3, 8), _t(1, 3, 8),
                                                             _t(1, 3, 8), 5), ValueError, "unsqueeze_dim"),
    ("rope-unsqueeze-type", lambda: tk.apply_rotary_pos_emb(_t(1, 2, 3, 8), _t(1, 2, 3, 8), _t(1, 3, 8),
                                                            _t(1, 3, 8), 1.0), TypeError, "unsqueeze_dim"),
    ("swiglu-shape", lambda: tk.swiglu(_t(2, 8), _t(2, 9)), ValueError, "up"),
    ("swiglu-dtype", lambda: tk.swiglu(_t(2, 8), _t(2, 8, dtype=torch.bfloat16)), TypeError, "up"),
    ("swiglu-int", lambda: tk.swiglu(torch.ones(2, 8, dtype=torch.int64, device=DEVICE), _t(2, 8)), TypeError,
     "gate"),
    ("swiglu-meta", lambda: tk.swiglu(_t(2, 8), _t(2, 8, device=META)), ValueError, "up"),
    ("packed-odd", lambda: tk.swiglu_packed(_t(2, 7)), ValueError, "x"),
    ("packed-int", lambda: tk.swiglu_packed(torch.ones(2, 8, dtype=torch.int32, device=DEVICE)), TypeError, "x"),
    ("packed-0d", lambda: tk.swiglu_packed(_t()), ValueError, "x"),
]


@pytest.mark.parametrize("call,exc,arg", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_input_raises_naming_the_argument(call, exc, arg):
    with pytest.raises(exc) as info:
        call()
    msg = str(info.value)
    # the argument's name must appear as a word (not inside another identifier)
    assert re.search(rf"(?<![A-Za-z_]){re.escape(arg)}(?![A-Za-z_])", msg), msg



@backend_p
def test_empty_hidden_dim_and_no_heads(backend):
    """Fuzz counterexamples (Triton): a last dim of 0 failed reshape(-1, 0) ("ambiguous"), and a q
    with no heads failed select(head_dim, 0) in the rotary tables."""
    x = torch.randn(3, 2, 0, device=DEVICE)
    w = torch.randn(0, device=DEVICE)
    assert tk.rms_norm(x, w, backend=backend).shape == (3, 2, 0)
    assert tk.gated_rms_norm(x, x, w, backend=backend).shape == (3, 2, 0)
    assert tk.swiglu(x, x, backend=backend).shape == (3, 2, 0)
    q, k = torch.randn(2, 0, 5, 8, device=DEVICE), torch.randn(2, 3, 5, 8, device=DEVICE)
    cos, sin = torch.randn(2, 5, 8, device=DEVICE), torch.randn(2, 5, 8, device=DEVICE)
    qe, ke = tk.apply_rotary_pos_emb(q, k, cos, sin, backend=backend)
    _, ke_ref = apply_rotary_pos_emb_reference(q, k, cos, sin)
    assert qe.shape == q.shape
    assert_close(ke, ke_ref.double(), torch.float32, name="k")
