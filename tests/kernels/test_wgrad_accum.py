"""``twinkle_kernels.wgrad_accum``: ``main_grad += dy^T @ x`` (megatron's gradient accumulation
fusion) against the float64 formula and against the unfused path it replaces (the product in the
inputs' dtype, then the add), over row counts around the cpu backend's 256-row tiles and the
thread split, non-contiguous operands, empty dims, and bad input named with nothing written; with
``accumulate=False``, ``main_grad = dy^T @ x`` over a NaN-filled buffer: every entry written, the
values of adding into zeros."""
import pytest
import torch

import twinkle_kernels as tk
from twinkle_kernels import _cpu_ext
from twinkle_kernels.testing import assert_close
from twinkle_kernels.wgrad import wgrad_accum_reference

BACKENDS = ["reference"] + (["cpu"] if _cpu_ext.unavailable_reason() is None else [])
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 1, 1), (7, 5, 3), (64, 257, 33), (512, 300, 96), (33, 513, 17), (3, 16, 1024)]


def _operands(M, N, K, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    dy = torch.randn(M, N, generator=g).to(dtype)
    main = torch.randn(N, K, generator=g)
    return x, dy, main


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_float64_and_the_unfused_path(shape, dtype, backend):
    M, N, K = shape
    x, dy, main = _operands(M, N, K, dtype)
    want64 = main.double() + dy.double().t() @ x.double()
    unfused = main.clone()
    unfused.add_((dy.t() @ x).to(torch.float32))
    got = main.clone()
    tk.wgrad_accum(x, dy, got, backend=backend)
    # the product is rounded to the inputs' dtype (as autograd's weight gradient): the float64
    # formula is met at that dtype's tolerance, scaled by the sum's size
    scale = max(1.0, float(want64.abs().max()))
    assert_close(got, want64, dtype, scale=max(1.0, M ** 0.5), atol_scale=scale)
    # against the path it replaces: one rounding of the product apart at most (the GEMM may sum
    # the M products in another order per tile)
    ulp = {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    torch.testing.assert_close(got, unfused, rtol=ulp, atol=ulp * scale)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES + [(0, 5, 3)], ids=lambda s: "x".join(map(str, s)))
def test_overwrite_is_adding_into_zeros(shape, dtype, backend):
    M, N, K = shape
    x, dy, _ = _operands(M, N, K, dtype, seed=4)
    into_zeros = torch.zeros(N, K)
    tk.wgrad_accum(x, dy, into_zeros, backend=backend)
    got = torch.full((N, K), float("nan"))      # a stale buffer: none of it may survive
    tk.wgrad_accum(x, dy, got, accumulate=False, backend=backend)
    torch.testing.assert_close(got, into_zeros, rtol=0, atol=0)
    # a view 5 floats into its storage (a DDP buffer's params sit at any offset): the cpu backend's
    # streaming stores start at the first 64-byte boundary; the neighbours are left alone
    store = torch.full((N * K + 10,), float("nan"))
    view = store[5:5 + N * K].view(N, K)
    tk.wgrad_accum(x, dy, view, accumulate=False, backend=backend)
    torch.testing.assert_close(view, into_zeros, rtol=0, atol=0)
    assert bool(store[:5].isnan().all()) and bool(store[5 + N * K:].isnan().all())
    # and then accumulating onto it is the usual path
    tk.wgrad_accum(x, dy, got, backend=backend)
    tk.wgrad_accum(x, dy, into_zeros, backend=backend)
    torch.testing.assert_close(got, into_zeros, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_accumulate_must_be_a_bool(backend):
    x, dy, main = _operands(4, 3, 2, torch.float32)
    before = main.clone()
    with pytest.raises(TypeError, match="accumulate must be a bool"):
        tk.wgrad_accum(x, dy, main, accumulate=0, backend=backend)
    torch.testing.assert_close(main, before, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_accumulates_into_what_is_there(backend):
    x, dy, main = _operands(40, 300, 24, torch.bfloat16, seed=1)
    once = torch.zeros_like(main)
    tk.wgrad_accum(x, dy, once, backend=backend)
    twice = torch.zeros_like(main)
    tk.wgrad_accum(x, dy, twice, backend=backend)
    tk.wgrad_accum(x, dy, twice, backend=backend)
    torch.testing.assert_close(twice, once + once, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_inputs(backend):
    x, dy, main = _operands(48, 260, 40, torch.bfloat16, seed=2)
    xt = x.t().contiguous().t()            # column-major [M, K]
    dyt = dy.t().contiguous().t()
    a, b = main.clone(), main.clone()
    tk.wgrad_accum(x, dy, a, backend=backend)
    tk.wgrad_accum(xt, dyt, b, backend=backend)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(0, 5, 3), (4, 0, 3), (4, 5, 0)])
def test_empty_dims_leave_main_grad(shape, backend):
    M, N, K = shape
    x, dy, main = _operands(M, N, K, torch.bfloat16)
    before = main.clone()
    tk.wgrad_accum(x, dy, main, backend=backend)
    torch.testing.assert_close(main, before, rtol=0, atol=0)


@pytest.mark.skipif("cpu" not in BACKENDS, reason="the C++ extension is not built")
def test_thread_count_does_not_change_the_sums():
    x, dy, main = _operands(96, 1000, 64, torch.bfloat16, seed=3)
    prev = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            m = main.clone()
            tk.wgrad_accum(x, dy, m, backend="cpu")
            outs.append(m)
    finally:
        torch.set_num_threads(prev)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def _bad(kind):
    x, dy, main = _operands(8, 6, 4, torch.bfloat16)
    if kind == "main_dtype":
        return (x, dy, main.bfloat16()), TypeError, "main_grad must be float32"
    if kind == "main_shape":
        return (x, dy, main[:5]), ValueError, "main_grad has shape"
    if kind == "main_strided":
        return (x, dy, torch.zeros(4, 6).t()), ValueError, "main_grad must be contiguous"
    if kind == "rows":
        return (x, dy[:7], main), ValueError, "dy has 7 rows but x has 8"
    if kind == "dtypes":
        return (x, dy.float(), main), TypeError, "dy has dtype"
    if kind == "ndim":
        return (x[None], dy, main), ValueError, "must be 2-D"
    if kind == "int":
        return (x.to(torch.int32), dy.to(torch.int32), main), TypeError, "x must be a floating tensor"
    raise AssertionError(kind)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["main_dtype", "main_shape", "main_strided", "rows", "dtypes", "ndim", "int"])
def test_bad_input_is_named_and_nothing_is_written(kind, backend):
    args, exc, match = _bad(kind)
    before = args[2].clone()
    with pytest.raises(exc, match=match):
        tk.wgrad_accum(*args, backend=backend)
    torch.testing.assert_close(args[2], before, rtol=0, atol=0, equal_nan=True)


def test_reference_is_the_unfused_formula():
    x, dy, main = _operands(5, 4, 3, torch.float32)
    m = main.clone()
    wgrad_accum_reference(x, dy, m)
    torch.testing.assert_close(m, main + dy.t() @ x)
    wgrad_accum_reference(x, dy, m, accumulate=False)
    torch.testing.assert_close(m, dy.t() @ x)
