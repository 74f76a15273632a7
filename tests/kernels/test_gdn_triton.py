"""Triton gated delta rule (chunked fwd+bwd, fused recurrent fwd) against the float64 recurrence.

On a machine without CUDA the kernels run in the Triton interpreter on CPU tensors
(conftest sets ``TRITON_INTERPRET=1``), in fp32 at small shapes; on CUDA the same tests
also run in bf16 / fp16 I/O.
"""
import pytest
import torch

import twinkle_kernels as tk
from twinkle_kernels import testing

from conftest import triton_available

try:
    import triton
    import triton.language as tl

    from twinkle_kernels.gdn._triton_common import round_bf16
except ImportError:   # no triton here: every test below is skipped
    triton = None

if triton is not None:
    @triton.jit
    def _round_bf16_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(y_ptr + offs, round_bf16(tl.load(x_ptr + offs, mask=m, other=0.0)), mask=m)

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton backend unavailable here")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter computes bf16 arithmetic wrongly, but these kernels only load/store bf16/fp16 and
# compute in fp32, which it gets right: on CPU one low-precision case runs (test_low_precision_io_*),
# on CUDA every case runs in every dtype.
DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if DEVICE == "cuda" else [])
OP = "gated_delta_rule"  # the op family key of testing.OP_SCALE, shared with tests/kernels/test_gdn.py


# Every (K, V) is its own set of Triton compilations on a GPU (the block sizes are compile-time),
# ~10 kernels of up to tens of seconds each: on CUDA the small dims map to Qwen-sized ones that
# share one block configuration (BK = 128, BV = 64), keeping K != V and non-power-of-two cases.
_CUDA_K = {16: 128, 32: 100, 64: 128}
_CUDA_V = {16: 128, 32: 72, 48: 128, 64: 96}


def _kv(K, V):
    return (_CUDA_K[K], _CUDA_V[V]) if DEVICE == "cuda" else (K, V)


def _inputs(B, T, H, HV, K, V, *, l2norm, n_states=None, dtype=torch.float32, with_h0=True):
    """Inputs in a stable regime (||k|| <= 1 without in-op l2norm, beta in (0, 1), g < 0)."""
    K, V = _kv(K, V)
    q = torch.randn(B, T, H, K, dtype=torch.float64)
    k = torch.randn(B, T, H, K, dtype=torch.float64)
    if not l2norm:
        k = k / k.norm(dim=-1, keepdim=True)
        q = q / q.norm(dim=-1, keepdim=True)
    v = torch.randn(B, T, HV, V, dtype=torch.float64)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, dtype=torch.float64) + 2.0)
    beta = torch.rand(B, T, HV, dtype=torch.float64)
    n = B if n_states is None else n_states
    h0 = torch.randn(n, HV, K, V, dtype=torch.float64) if with_h0 else None
    cast = [x.to(DEVICE, dtype) for x in (q, k, v)] + [x.to(DEVICE, torch.float32) for x in (g, beta)]
    if h0 is not None:
        cast.append(h0.to(DEVICE, torch.float32))
    return cast


def _run(fn_backend, xs, *, l2norm, cu=None, chunk_size=64, grad_seed=1, want_ht=True, operands=None):
    """(o, ht, grads of every input) for one backend, with fixed random output cotangents;
    ``operands`` picks the triton kernels' dot operand precision (default: from the dtype)."""
    xs = [x.detach().clone().requires_grad_(True) for x in xs]
    q, k, v, g, beta = xs[:5]
    h0 = xs[5] if len(xs) > 5 else None
    backend, dt = fn_backend
    if backend == "reference":
        xs64 = [x.detach().double().requires_grad_(True) for x in xs]
        xs = xs64
        q, k, v, g, beta = xs[:5]
        h0 = xs[5] if len(xs) > 5 else None
    if operands is None:
        o, ht = tk.chunk_gated_delta_rule(q, k, v, g, beta, None, h0, want_ht, l2norm, cu,
                                          chunk_size=chunk_size, backend=backend)
    else:
        from twinkle_kernels.gdn import _triton
        o, ht = _triton.chunk_gated_delta_rule(q, k, v, g, beta, q.shape[-1] ** -0.5, h0, want_ht, l2norm, cu,
                                               chunk_size, operands=operands)
    gen = torch.Generator().manual_seed(grad_seed)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device)
    loss = (o.double() * do).sum()
    if want_ht:
        dht = torch.randn(ht.shape, generator=gen, dtype=torch.float64).to(ht.device)
        loss = loss + (ht.double() * dht).sum()
    grads = torch.autograd.grad(loss, xs)
    return o.detach(), (ht.detach() if want_ht else None), grads


NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def _compare(got, ref, dtype, scale=1.0):
    o, ht, grads = got
    ro, rht, rgrads = ref
    testing.assert_close(o, ro, dtype, op=OP, name="o", scale=scale)
    if rht is not None:
        testing.assert_close(ht, rht, torch.float32 if dtype == torch.float32 else dtype, op=OP,
                             name="final_state", scale=scale)
    for name, a, b in zip(NAMES, grads, rgrads):
        testing.assert_close(a, b, dtype, op=OP, name=f"d{name}", scale=scale)


def _low_precision_scale(dtype):
    # bf16/fp16 inputs are rounded once on the way in; the gradients sum a chunk of such terms.
    return 1.0 if dtype == torch.float32 else 4.0


CASES = [
    # B, T, H, HV, K, V, l2norm, with_h0
    (1, 1, 1, 1, 16, 16, False, False),
    (2, 63, 1, 2, 16, 32, True, True),
    (1, 64, 2, 2, 32, 16, False, True),
    (1, 65, 1, 2, 32, 32, True, False),
    (1, 200, 1, 1, 32, 64, True, True),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}T{}H{}HV{}K{}V{}-l2{}-h0{}".format(*c))
def test_chunk_matches_reference(case, dtype):
    B, T, H, HV, K, V, l2, with_h0 = case
    xs = _inputs(B, T, H, HV, K, V, l2norm=l2, dtype=dtype, with_h0=with_h0)
    got = _run(("triton", dtype), xs, l2norm=l2)
    ref = _run(("reference", dtype), xs, l2norm=l2)
    _compare(got, ref, dtype, _low_precision_scale(dtype))


@pytest.mark.skipif(DEVICE == "cuda", reason="covered by test_chunk_matches_reference on CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_io_in_interpreter(dtype):
    """bf16/fp16 loads and stores, fp16 dot operands. The interpreter's bf16 dots are garbage, so
    bf16 inputs run with emulated bf16 operands (fp32 rounded to bf16) there."""
    xs = _inputs(1, 70, 1, 2, 32, 32, l2norm=True, dtype=dtype)
    got = _run(("triton", dtype), xs, l2norm=True, operands="bf16emu" if dtype == torch.bfloat16 else None)
    ref = _run(("reference", dtype), xs, l2norm=True)
    _compare(got, ref, dtype, _low_precision_scale(dtype))


def _bf16_values(xs):
    """The inputs rounded to bf16 and held in fp32, as a bf16 caller would pass them."""
    return [x.to(torch.bfloat16).to(x.dtype) if i < 3 else x for i, x in enumerate(xs)]


EMU_CASES = [
    # B, T, H, HV, K, V, l2norm, with_h0, lens (packed) or None
    (1, 70, 1, 2, 64, 32, True, True, None),
    (2, 40, 1, 2, 128, 64, False, True, None),
    (1, 90, 2, 4, 32, 48, True, True, [0, 1, 50, 50, 90]),
    (1, 33, 1, 1, 256, 32, True, False, None),
    (1, 20, 1, 2, 128, 256, True, True, None),
]


@pytest.mark.parametrize("case", EMU_CASES, ids=lambda c: "B{}T{}H{}HV{}K{}V{}-l2{}-h0{}-packed{}".format(
    *c[:8], c[8] is not None))
def test_emulated_bf16_operands(case):
    """The bf16 path's numerics without a GPU: the same kernels with every dot operand and stored
    intermediate rounded to bf16 (operands="bf16emu"), against the float64 reference at bf16
    tolerances; and the rounding must really happen (the result differs from fp32 operands)."""
    B, T, H, HV, K, V, l2, with_h0, lens = case
    cu = None
    if lens is not None:
        cu = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    n = None if lens is None else len(lens) - 1
    xs = _bf16_values(_inputs(B, T, H, HV, K, V, l2norm=l2, n_states=n, with_h0=with_h0))
    got = _run(("triton", torch.float32), xs, l2norm=l2, cu=cu, operands="bf16emu")
    ref = _run(("reference", torch.float32), xs, l2norm=l2, cu=cu)
    _compare(got, ref, torch.bfloat16, _low_precision_scale(torch.bfloat16))
    exact = _run(("triton", torch.float32), xs, l2norm=l2, cu=cu)
    # fp32 operands agree to ~1e-7 of the output's size; bf16 roundings move it by ~1e-3 of it
    size = float(exact[0].abs().max())
    assert testing.max_error(got[0], exact[0]) > 1e-5 * size, "operands='bf16emu' did not round the dot operands"


def test_round_bf16_is_round_to_nearest_even():
    """The integer-bit rounding the emulated bf16 path uses equals torch's fp32 -> bf16 cast
    (round to nearest, ties to even), including exact ties and values near powers of two."""
    kernel = _round_bf16_kernel
    base = torch.randn(1000, dtype=torch.float64).to(torch.float32)
    bits = base.to(torch.bfloat16).to(torch.float32).view(torch.int32)
    ties = (bits + 0x8000).view(torch.float32)            # exactly half-way between two bf16 values
    odd_ties = ((bits | 0x10000) + 0x8000).view(torch.float32)
    x = torch.cat([base, ties, odd_ties, torch.tensor([0.0, -0.0, 1.0, 2.0 ** -126, 3.0e38, -1.5])]).to(DEVICE)
    y = torch.empty_like(x)
    kernel[(triton.cdiv(x.numel(), 256),)](x, y, x.numel(), BLOCK=256)
    assert torch.equal(y.cpu(), x.cpu().to(torch.bfloat16).to(torch.float32))


@pytest.mark.parametrize("chunk_size", [16, 32, 128])
def test_chunk_sizes_agree(chunk_size):
    xs = _inputs(1, 45, 1, 2, 16, 16, l2norm=True)
    got = _run(("triton", torch.float32), xs, l2norm=True, chunk_size=chunk_size)
    ref = _run(("reference", torch.float32), xs, l2norm=True)
    _compare(got, ref, torch.float32)


def test_without_final_state_and_noncontiguous():
    B, T, H, HV, K, V = 2, 40, 2, 2, 16, 32
    q, k, v, g, beta, h0 = _inputs(B, T, H, HV, K, V, l2norm=True)
    # non-contiguous q/k/v/g: the same values seen through a transpose
    qn = q.transpose(1, 2).contiguous().transpose(1, 2)
    vn = v.transpose(1, 2).contiguous().transpose(1, 2)
    gn = g.transpose(0, 1).contiguous().transpose(0, 1)
    assert not qn.is_contiguous() and not vn.is_contiguous() and not gn.is_contiguous()
    got = _run(("triton", torch.float32), [qn, k, vn, gn, beta, h0], l2norm=True, want_ht=False)
    ref = _run(("reference", torch.float32), [q, k, v, g, beta, h0], l2norm=True, want_ht=False)
    assert got[1] is None
    _compare(got, ref, torch.float32)


@pytest.mark.parametrize("lens", [[1, 70, 0, 33], [64, 1, 5, 0]], ids=["len1-mid-empty", "empty-tail"])
def test_packed_equals_separate(lens):
    H, HV, K, V = 1, 2, 16, 32
    T = sum(lens)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device=DEVICE)
    q, k, v, g, beta, h0 = _inputs(1, T, H, HV, K, V, l2norm=True, n_states=len(lens))
    packed = _run(("triton", torch.float32), [q, k, v, g, beta, h0], l2norm=True, cu=cu)
    # against the reference with the same packing
    ref = _run(("reference", torch.float32), [q, k, v, g, beta, h0], l2norm=True, cu=cu)
    _compare(packed, ref, torch.float32)
    # and against separate triton calls, one per sequence
    o, ht, grads = packed
    for n, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if e == s:
            # an empty sequence passes its initial state through; its state gradient is dht
            testing.assert_close(ht[n], h0[n], torch.float32, op=OP, name=f"final_state[{n}] (empty)")
            continue
        part = [x[:, s:e] for x in (q, k, v, g, beta)] + [h0[n:n + 1]]
        sep = _run(("triton", torch.float32), part, l2norm=True, grad_seed=100 + n)
        # cotangents differ between the runs: compare forward values directly
        testing.assert_close(o[:, s:e], sep[0], torch.float32, op=OP, name=f"o[seq {n}]")
        testing.assert_close(ht[n:n + 1], sep[1], torch.float32, op=OP, name=f"final_state[{n}]")


def test_packed_gradients_equal_separate():
    """Gradients of one packed call equal those of N separate calls under the same cotangents."""
    lens = [1, 50, 30]
    H, HV, K, V = 1, 1, 16, 16
    T = sum(lens)
    cu = torch.tensor([0, 1, 51, 81], dtype=torch.int64, device=DEVICE)
    xs = _inputs(1, T, H, HV, K, V, l2norm=True, n_states=3)
    xs = [x.detach().requires_grad_(True) for x in xs]
    do = torch.randn(xs[2].shape, device=DEVICE)
    dht = torch.randn(xs[5].shape, device=DEVICE)
    o, ht = tk.chunk_gated_delta_rule(*xs[:5], None, xs[5], True, True, cu, backend="triton")
    gp = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), xs)
    for n, (s, e) in enumerate(zip([0, 1, 51], [1, 51, 81])):
        part = [x.detach()[:, s:e].clone().requires_grad_(True) for x in xs[:5]]
        h0 = xs[5].detach()[n:n + 1].clone().requires_grad_(True)
        o1, ht1 = tk.chunk_gated_delta_rule(*part, None, h0, True, True, backend="triton")
        g1 = torch.autograd.grad((o1 * do[:, s:e]).sum() + (ht1 * dht[n:n + 1]).sum(), part + [h0])
        for name, a, b in zip(NAMES[:5], gp[:5], g1[:5]):
            testing.assert_close(a[:, s:e], b, torch.float32, op=OP, name=f"d{name}[seq {n}]")
        testing.assert_close(gp[5][n:n + 1], g1[5], torch.float32, op=OP, name=f"dinitial_state[{n}]")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("l2", [False, True])
def test_fused_recurrent_matches_reference(l2, dtype):
    cu = torch.tensor([0, 1, 30, 30, 77], dtype=torch.int32, device=DEVICE)
    xs = _inputs(1, 77, 1, 2, 32, 16, l2norm=l2, n_states=4, dtype=dtype)
    with torch.no_grad():
        o, ht = tk.fused_recurrent_gated_delta_rule(*xs[:5], None, xs[5], True, l2, cu, backend="triton")
        x64 = [x.double() for x in xs]
        ro, rht = tk.fused_recurrent_gated_delta_rule(*x64[:5], None, x64[5], True, l2, cu, backend="reference")
    testing.assert_close(o, ro, dtype, op=OP, name="o", scale=_low_precision_scale(dtype))
    testing.assert_close(ht, rht, torch.float32 if dtype == torch.float32 else dtype, op=OP, name="final_state",
                         scale=_low_precision_scale(dtype))


def test_decode_steps_match_chunked():
    """Decoding token by token, carrying the state, equals one chunked call over the sequence."""
    B, T, H, HV, K, V = 2, 9, 1, 2, 16, 16
    q, k, v, g, beta, h0 = _inputs(B, T, H, HV, K, V, l2norm=True)
    with torch.no_grad():
        o_full, ht_full = tk.chunk_gated_delta_rule(q, k, v, g, beta, None, h0, True, True, backend="triton")
        state, outs = h0, []
        for t in range(T):
            sl = slice(t, t + 1)
            o_t, state = tk.fused_recurrent_gated_delta_rule(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl],
                                                             None, state, True, True, backend="triton")
            outs.append(o_t)
    testing.assert_close(torch.cat(outs, 1), o_full.double(), torch.float32, op=OP, name="o (decode)")
    testing.assert_close(state, ht_full.double(), torch.float32, op=OP, name="final_state (decode)")


def test_strong_decay_does_not_overflow():
    """Decays of exp(-40) per token underflow exp(cumsum g) inside a chunk: no inf * 0 = NaN."""
    q, k, v, g, beta, h0 = _inputs(1, 70, 1, 1, 16, 16, l2norm=True)
    g = g.clone()
    g[:, 10:40] = -40.0
    got = _run(("triton", torch.float32), [q, k, v, g, beta, h0], l2norm=True)
    ref = _run(("reference", torch.float32), [q, k, v, g, beta, h0], l2norm=True)
    _compare(got, ref, torch.float32)


def test_key_dim_over_limit_is_refused():
    from twinkle_kernels.gdn import _triton
    q = torch.zeros(1, 2, 1, 512, device=DEVICE)
    v = torch.zeros(1, 2, 1, 16, device=DEVICE)
    assert "K <= 256" in _triton.unsupported_reason(q, v)
    assert _triton.unsupported_reason(q[..., :256], v) is None
    with pytest.raises(ValueError, match="K <= 256"):
        _triton.chunk_gated_delta_rule(q, q, v, v[..., 0], v[..., 0], 1.0, None, False, False, None, 64)


def test_zero_length():
    q, k, v, g, beta, h0 = _inputs(1, 0, 1, 1, 16, 16, l2norm=True)
    o, ht = tk.chunk_gated_delta_rule(q, k, v, g, beta, None, h0, True, True, backend="triton")
    assert o.shape == (1, 0, 1, v.shape[-1])
    testing.assert_close(ht, h0.double(), torch.float32, op=OP, name="final_state (T=0)")


CONV_CASES = [
    # B, D, T, W, bias, activation, cu_seqlens
    (2, 5, 37, 4, True, "silu", None),
    (1, 40, 150, 3, False, None, [0, 1, 60, 60, 150]),
    (1, 3, 1, 4, True, "silu", None),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CONV_CASES, ids=["bias-silu", "packed-nobias", "T1"])
def test_causal_conv1d_matches_reference(case, dtype):
    B, D, T, W, with_bias, act, cu = case
    cu = torch.tensor(cu, dtype=torch.int32, device=DEVICE) if cu is not None else None
    x = torch.randn(B, D, T, dtype=torch.float64).to(DEVICE, dtype)
    w = torch.randn(D, W, dtype=torch.float64).to(DEVICE, torch.float32)
    b = torch.randn(D, dtype=torch.float64).to(DEVICE, torch.float32) if with_bias else None
    ins = [t.requires_grad_(True) for t in (x, w, b) if t is not None]
    ins64 = [t.detach().double().requires_grad_(True) for t in ins]
    y = tk.causal_conv1d(ins[0], ins[1], ins[2] if with_bias else None, act, cu, backend="triton")
    ref = tk.causal_conv1d(ins64[0], ins64[1], ins64[2] if with_bias else None, act, cu, backend="reference")
    dy = torch.randn(y.shape, dtype=torch.float64, device=DEVICE)
    grads = torch.autograd.grad((y.double() * dy).sum(), ins)
    rgrads = torch.autograd.grad((ref * dy).sum(), ins64)
    testing.assert_close(y, ref, dtype, op=OP, name="y")
    # dw / dbias sum over B * T positions
    for name, a, r in zip(("x", "weight", "bias"), grads, rgrads):
        testing.assert_close(a, r, dtype, op=OP, name=f"d{name}", scale=1.0 if name == "x" else (B * T) ** 0.5)
