"""Depthwise causal conv1d (and its decode step) on every backend against the float64 reference."""
import pytest
import torch

import twinkle_kernels as tk
from twinkle_kernels import _dispatch, testing
from twinkle_kernels.gdn import causal_conv1d_reference, causal_conv1d_update_reference

from conftest import available_backends

OP = "causal_conv1d"


def _serving():
    """Backends of this machine that serve causal_conv1d (triton appears once its kernel exists)."""
    x, w = torch.randn(1, 4, 8), torch.randn(4, 4)
    op = _dispatch.op(OP)
    return [b for b in available_backends() if op.reason(b, x, w, None, "silu", None) is None]


BACKENDS = _serving()


def _skip_unsupported(backend, dtype):
    if backend == "triton" and _dispatch.triton_interpret() and dtype != torch.float32:
        pytest.skip("bf16 math is wrong in the Triton interpreter")


def _run(fn, x, w, b, dy, **kw):
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in (x, w, b)]
    y = fn(*leaves, **kw)
    grads = torch.autograd.grad((y.double() * dy).sum(), [t for t in leaves if t is not None])
    return y, grads


def _inputs(B, D, T, W, dtype, bias, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, D, T, generator=gen).to(dtype)
    w = (torch.randn(D, W, generator=gen) / W ** 0.5).to(dtype)
    b = torch.randn(D, generator=gen).to(dtype) if bias else None
    return x, w, b


def _check(got, want, dtype, T):
    (y, grads), (y64, grads64) = got, want
    testing.assert_close(y, y64, dtype, op=OP, name="y")
    for n, a, e in zip(("x", "weight", "bias"), grads, grads64):
        # weight and bias gradients sum over B * T positions
        testing.assert_close(a, e, dtype, op=OP, name=f"d{n}", scale=1.0 if n == "x" else max(1.0, (2 * T) ** 0.5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("T,W", [(1, 4), (3, 4), (64, 4), (65, 2), (130, 3)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_float64_reference(backend, T, W, bias, activation, dtype):
    _skip_unsupported(backend, dtype)
    x, w, b = _inputs(2, 17, T, W, dtype, bias, seed=T)
    dy = torch.randn(2, 17, T, dtype=torch.float64)
    got = _run(tk.causal_conv1d, x, w, b, dy, activation=activation, backend=backend)
    want = _run(causal_conv1d_reference, *[t.double() if t is not None else None for t in (x, w, b)], dy,
                activation=activation)
    assert got[0].dtype == dtype
    _check(got, want, dtype, T)


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_equals_separate_calls(backend):
    cu = [0, 1, 9, 9, 40, 40]  # length 1, an empty middle and an empty tail
    x, w, b = _inputs(1, 6, cu[-1], 4, torch.float32, True, seed=3)
    dy = torch.randn(1, 6, cu[-1], dtype=torch.float64)
    y, grads = _run(tk.causal_conv1d, x, w, b, dy, cu_seqlens=torch.tensor(cu), backend=backend)
    dw, db = torch.zeros_like(w, dtype=torch.float64), torch.zeros_like(b, dtype=torch.float64)
    for a, e in zip(cu, cu[1:]):
        y_n, g_n = _run(tk.causal_conv1d, x[:, :, a:e], w, b, dy[:, :, a:e], backend=backend)
        testing.assert_close(y[:, :, a:e], y_n.double(), torch.float32, op=OP, name=f"y of [{a}, {e})")
        testing.assert_close(grads[0][:, :, a:e], g_n[0].double(), torch.float32, op=OP, name=f"dx of [{a}, {e})")
        dw += g_n[1].double()
        db += g_n[2].double()
    testing.assert_close(grads[1], dw, torch.float32, op=OP, name="dweight", scale=4.0)
    testing.assert_close(grads[2], db, torch.float32, op=OP, name="dbias", scale=4.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_inf_stays_in_its_sequence(backend):
    """An Inf in one packed sequence must not reach the next: a token before its sequence's start
    reads zero (the reference multiplied it by a 0 mask, and Inf * 0 is NaN)."""
    cu = [0, 5, 11, 16]
    x, w, b = _inputs(1, 3, cu[-1], 4, torch.float32, True, seed=4)
    x[0, 0, 4] = float("inf")
    x[0, 1, 10] = float("nan")
    y = tk.causal_conv1d(x, w, b, "silu", torch.tensor(cu), backend=backend)
    for a, e in zip(cu, cu[1:]):
        y_n = causal_conv1d_reference(x[:, :, a:e].double(), w.double(), b.double(), "silu")
        assert torch.equal(torch.isnan(y[:, :, a:e]), torch.isnan(y_n)), f"NaN pattern of [{a}, {e})"
        finite = torch.isfinite(y_n)
        torch.testing.assert_close(y[:, :, a:e][finite].double(), y_n[finite], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(y[:, :, 11:]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_transformers_causal_conv1d_fn(backend):
    m = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    x, w, b = _inputs(2, 8, 33, 4, torch.float64, True, seed=5)
    want = m.causal_conv1d_fn(x, w, b, activation="silu")
    got = tk.causal_conv1d(x.float(), w.float(), b.float(), "silu", backend=backend)
    testing.assert_close(got, want, torch.float32, op=OP)


# --- decode step ---------------------------------------------------------------------------------

def test_update_matches_transformers_including_the_state():
    m = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    x, w, b = _inputs(2, 8, 3, 4, torch.float64, True, seed=6)
    state = torch.randn(2, 8, 4, dtype=torch.float64)
    state_hf = state.clone()
    y = tk.causal_conv1d_update(x, state, w, b, "silu")
    y_hf = m.causal_conv1d_update(x, state_hf, w, b, "silu")
    torch.testing.assert_close(y, y_hf, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(state, state_hf, atol=0, rtol=0)


def _serving_update():
    x, state, w = torch.randn(1, 4, 1), torch.zeros(1, 4, 3), torch.randn(4, 4)
    op = _dispatch.op("causal_conv1d_update")
    return [b for b in available_backends() if op.reason(b, x, state, w, None, "silu") is None]


UPDATE_BACKENDS = _serving_update()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("S,L,W", [(1, 3, 4), (1, 6, 4), (3, 3, 4), (5, 2, 3), (2, 1, 2)])
@pytest.mark.parametrize("backend", UPDATE_BACKENDS)
def test_update_matches_float64_reference_and_rolls_the_state(backend, S, L, W, bias, activation, dtype):
    _skip_unsupported(backend, dtype)
    x, w, b = _inputs(3, 7, S, W, dtype, bias, seed=S * 10 + L)
    state = torch.randn(3, 7, L).to(dtype)
    state64 = state.double()
    y = tk.causal_conv1d_update(x, state, w, b, activation, backend=backend)
    y64 = causal_conv1d_update_reference(x.double(), state64, w.double(), None if b is None else b.double(),
                                         activation)
    assert y.dtype == dtype and y.shape == x.shape
    testing.assert_close(y, y64, dtype, op=OP, name="y")
    # the new state is the window's last L inputs: copied values, exact in any dtype
    torch.testing.assert_close(state.double(), state64, atol=0, rtol=0)


@pytest.mark.parametrize("backend", UPDATE_BACKENDS)
def test_update_one_token_2d_and_a_state_of_another_dtype_and_layout(backend):
    x, w, b = _inputs(2, 6, 1, 4, torch.float32, True, seed=21)
    base = torch.randn(2, 5, 6).transpose(1, 2)  # [2, 6, 5], not contiguous
    state = base.to(torch.bfloat16)[:, :, 1:]    # [2, 6, 4] bf16, a strided view updated in place
    want_state = state.double().clone()
    y = tk.causal_conv1d_update(x[:, :, 0], state, w, b, "silu", backend=backend)
    y64 = causal_conv1d_update_reference(x[:, :, 0].double(), want_state, w.double(), b.double(), "silu")
    assert y.shape == (2, 6)
    testing.assert_close(y, y64, torch.float32, op=OP)
    torch.testing.assert_close(state.double(), want_state.to(torch.bfloat16).double(), atol=0, rtol=0)


@pytest.mark.parametrize("S", [1, 3])
@pytest.mark.parametrize("backend", UPDATE_BACKENDS)
def test_update_with_an_empty_state(backend, S):
    """W == 1 admits an empty state (L == 0): it keeps nothing. The C++ one-token path wrote
    state[L - 1], one float before the state (a segfault or a corrupted neighbour); the reference
    copied the whole window into it (window[..., -0:])."""
    x, w, b = _inputs(2, 8, S, 1, torch.float32, True, seed=12)
    guard = torch.zeros(40)
    state = guard[20:20].view(2, 8, 0)  # an empty view inside a buffer: a stray write shows up in it
    x_in = x[:, :, 0] if S == 1 else x
    y = tk.causal_conv1d_update(x_in, state, w, b, "silu", backend=backend)
    want = torch.nn.functional.silu(x.double() * w.double()[:, :1] + b.double()[:, None])
    testing.assert_close(y, want[:, :, 0] if S == 1 else want, torch.float32, op=OP)
    assert torch.equal(guard, torch.zeros(40)), "causal_conv1d_update wrote outside conv_state"


def test_update_with_gradients_goes_to_the_reference():
    x, w, b = _inputs(1, 4, 1, 4, torch.float32, True, seed=2)
    w.requires_grad_(True)
    op = _dispatch.op("causal_conv1d_update")
    if "cpu" in available_backends():
        assert "forward only" in op.reason("cpu", x, torch.zeros(1, 4, 3), w, b, "silu")
    y = tk.causal_conv1d_update(x, torch.zeros(1, 4, 3), w, b, "silu")
    assert y.requires_grad


@pytest.mark.parametrize("backend", UPDATE_BACKENDS)
@pytest.mark.parametrize("state_len", [3, 4])
def test_decoding_token_by_token_equals_the_full_conv(state_len, backend):
    x, w, b = _inputs(2, 5, 12, 4, torch.float32, True, seed=8)
    full = tk.causal_conv1d(x, w, b, "silu")
    state = torch.zeros(2, 5, state_len)
    steps = [tk.causal_conv1d_update(x[:, :, t], state, w, b, "silu", backend=backend) for t in range(12)]
    testing.assert_close(torch.stack(steps, -1), causal_conv1d_reference(x.double(), w.double(), b.double(), "silu"),
                         torch.float32, op=OP)
    testing.assert_close(full, torch.stack(steps, -1).double(), torch.float32, op=OP, name="full vs decoded")
    torch.testing.assert_close(state, x[:, :, -state_len:])


# --- bad input -------------------------------------------------------------------------------------

BAD = [
    ("x 2-D", dict(x=torch.randn(4, 8)), ValueError, "x must be 3-D"),
    ("x int", dict(x=torch.ones(1, 4, 8, dtype=torch.int64)), TypeError, "x must be a floating"),
    ("weight D", dict(weight=torch.randn(3, 4)), ValueError, r"weight must have shape \[D, W\] = \[4, W\]"),
    ("weight 3-D", dict(weight=torch.randn(4, 1, 4)), ValueError, "weight must have shape"),
    ("bias", dict(bias=torch.randn(5)), ValueError, r"bias must have shape \[D\]"),
    ("activation", dict(activation="relu"), ValueError, "activation must be one of"),
    ("cu B>1", dict(x=torch.randn(2, 4, 8), cu_seqlens=torch.tensor([0, 8])), ValueError, "batch size 1"),
    ("cu end", dict(cu_seqlens=torch.tensor([0, 7])), ValueError, "cu_seqlens must end at"),
    ("cu order", dict(cu_seqlens=torch.tensor([0, 5, 3, 8])), ValueError, "non-decreasing"),
    ("cu float", dict(cu_seqlens=torch.tensor([0.0, 8.0])), TypeError, "integer"),
    ("device", dict(bias=torch.randn(4, device="meta")), ValueError, "bias is on meta"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_names_the_argument(case):
    _, edits, exc, match = case
    args = dict(x=torch.randn(1, 4, 8), weight=torch.randn(4, 4), bias=torch.randn(4))
    args.update(edits)
    with pytest.raises(exc, match=match):
        tk.causal_conv1d(**args)


def test_update_bad_input():
    x, w = torch.randn(2, 4, 1), torch.randn(4, 4)
    with pytest.raises(ValueError, match="conv_state must have shape"):
        tk.causal_conv1d_update(x, torch.zeros(2, 4, 2), w)
    with pytest.raises(ValueError, match="conv_state must have shape"):
        tk.causal_conv1d_update(x, torch.zeros(1, 4, 4), w)
    with pytest.raises(TypeError, match="conv_state must be a floating"):
        tk.causal_conv1d_update(x, torch.zeros(2, 4, 4, dtype=torch.int32), w)
    with pytest.raises(ValueError, match="x must be"):
        tk.causal_conv1d_update(torch.randn(2, 4, 1, 1), torch.zeros(2, 4, 4), w)
