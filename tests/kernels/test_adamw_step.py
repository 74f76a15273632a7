"""``twinkle_kernels.adamw_step`` (one AdamW pass: scaled grads, fp32 master weights, the low-precision
copy written in the same pass) against the AdamW formula in float64 and against
``torch.optim.AdamW`` itself, on the C++ backend (``backend="cpu"``: a silent fallback would raise)
and the reference: sizes around the vector block and the parallel ranges, every grad and output
dtype, per-tensor step counts, non-contiguous grads, thread-count independence, and bad input
(refused before anything is written)."""
import math

import pytest
import torch

import twinkle_kernels as tk
from twinkle_kernels import _cpu_ext
from twinkle_kernels.testing import assert_close

needs_cpp = pytest.mark.skipif(_cpu_ext.unavailable_reason() is not None,
                               reason=f"C++ extension not built: {_cpu_ext.unavailable_reason()}")
BACKENDS = [pytest.param("cpu", marks=needs_cpp), "reference"]
LOW = [torch.float32, torch.bfloat16, torch.float16]
SIZES = [0, 1, 31, 32, 33, 1000, 32768, 32769, 3 * 32768 + 5]
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _state(sizes, seed, grad_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    p = [torch.randn(n, generator=g) * 0.05 for n in sizes]
    grads = [torch.randn(n, generator=g).to(grad_dtype) for n in sizes]
    m = [torch.randn(n, generator=g) * 0.01 for n in sizes]
    v = [torch.rand(n, generator=g) * 1e-3 for n in sizes]
    steps = [torch.tensor(float(k % 3)) for k in range(len(sizes))]   # each tensor its own count
    return p, grads, m, v, steps


def _ulps_close(x, y, n=4, what=""):
    """Within ``n`` float32 ulps of the tensor's largest entry: two fp32 evaluations of the same
    formula in a different order (a relative bound fails where an entry cancels to almost 0)."""
    bound = n * 2.0 ** -23 * max(float(y.abs().max()) if y.numel() else 0.0, 1e-30)
    err = float((x.double() - y.double()).abs().max()) if x.numel() else 0.0
    assert err <= bound, f"{what}: {err:.3g} > {bound:.3g}"


def _float64_step(p, g, m, v, t, *, lr, betas, eps, weight_decay, grad_factor):
    b1, b2 = betas
    p, g, m, v = (x.double() for x in (p, g, m, v))
    g = g * grad_factor
    p = p * (1 - lr * weight_decay)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    p = p - lr / (1 - b1 ** t) * m / (v.sqrt() / math.sqrt(1 - b2 ** t) + eps)
    return p, m, v


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("grad_dtype", LOW)
@pytest.mark.parametrize("out_dtype", [None] + LOW)
def test_matches_the_float64_formula(backend, grad_dtype, out_dtype):
    p, g, m, v, steps = _state(SIZES, LOW.index(grad_dtype), grad_dtype)
    want = [_float64_step(p[k], g[k], m[k], v[k], float(steps[k]) + 1, grad_factor=0.37, **HYPER)
            for k in range(len(SIZES))]
    out = None if out_dtype is None else [torch.full((n,), float("nan"), dtype=out_dtype) for n in SIZES]
    before = [float(s) for s in steps]
    tk.adamw_step(p, g, m, v, steps, grad_factor=0.37, out_params=out, backend=backend, **HYPER)
    for k, n in enumerate(SIZES):
        assert float(steps[k]) == before[k] + 1
        assert_close(p[k], want[k][0], torch.float32, name=f"params[{k}]")
        assert_close(m[k], want[k][1], torch.float32, name=f"exp_avgs[{k}]")
        assert_close(v[k], want[k][2], torch.float32, name=f"exp_avg_sqs[{k}]")
        if out is not None:   # the copy is the new fp32 weight rounded once, every element written
            assert torch.equal(out[k], p[k].to(out_dtype)), f"out_params[{k}]"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_three_steps_match_torch_adamw(backend, weight_decay):
    sizes = [7, 1000, 70001]
    p, g, m, v, steps = _state(sizes, 11)
    mine = [x.clone() for x in p]
    m = [torch.zeros_like(x) for x in p]
    v = [torch.zeros_like(x) for x in p]
    steps = [torch.tensor(0.0) for _ in p]
    theirs = [torch.nn.Parameter(x.clone()) for x in p]
    opt = torch.optim.AdamW(theirs, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay,
                            foreach=False)
    gen = torch.Generator().manual_seed(12)
    for _ in range(3):
        grads = [torch.randn(n, generator=gen) for n in sizes]
        for t, gr in zip(theirs, grads):
            t.grad = gr.clone()
        opt.step()
        tk.adamw_step(mine, grads, m, v, steps, lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                      weight_decay=weight_decay, backend=backend)
    for k, t in enumerate(theirs):
        st = opt.state[t]
        assert float(steps[k]) == float(st["step"]) == 3
        # torch's per-tensor loop runs the same fp32 operations one pass at a time: a few ulps
        _ulps_close(mine[k], t.detach(), what=f"params[{k}]")
        _ulps_close(m[k], st["exp_avg"], what=f"exp_avgs[{k}]")
        _ulps_close(v[k], st["exp_avg_sq"], what=f"exp_avg_sqs[{k}]")


@needs_cpp
@pytest.mark.parametrize("grad_dtype", LOW)
def test_cpu_agrees_with_the_reference(grad_dtype):
    a = _state(SIZES, 21, grad_dtype)
    b = tuple([x.clone() for x in xs] for xs in a)
    oa = [torch.empty(n, dtype=torch.bfloat16) for n in SIZES]
    ob = [torch.empty(n, dtype=torch.bfloat16) for n in SIZES]
    tk.adamw_step(*a, grad_factor=2.5, out_params=oa, backend="cpu", **HYPER)
    tk.adamw_step(*b, grad_factor=2.5, out_params=ob, backend="reference", **HYPER)
    for k, (x, y) in enumerate(zip(a[0] + a[2] + a[3], b[0] + b[2] + b[3])):
        _ulps_close(x, y, what=f"tensor {k}")
    # each copy is its own new fp32 weights rounded once (those agree to a few ulps above)
    for k in range(len(SIZES)):
        assert torch.equal(oa[k], a[0][k].bfloat16()) and torch.equal(ob[k], b[0][k].bfloat16())


@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_factor_is_the_scaled_gradient(backend):
    # g * factor rounded to fp32 in the kernel is the same as the grads scaled beforehand
    a = _state(SIZES, 31)
    b = tuple([x.clone() for x in xs] for xs in a)
    b[1][:] = [g * 0.125 for g in b[1]]
    tk.adamw_step(*a, grad_factor=0.125, backend=backend, **HYPER)
    tk.adamw_step(*b, backend=backend, **HYPER)
    for x, y in zip(a[0] + a[2] + a[3], b[0] + b[2] + b[3]):
        assert torch.equal(x, y)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("grad_dtype", LOW)
def test_zero_grads_zeroes_them_after_reading(backend, grad_dtype):
    a = _state(SIZES, 91, grad_dtype)
    b = tuple([x.clone() for x in xs] for xs in a)
    grads = list(a[1])
    tk.adamw_step(*a, grad_factor=0.5, zero_grads=True, backend=backend, **HYPER)
    tk.adamw_step(*b, grad_factor=0.5, backend=backend, **HYPER)
    assert all(g is h for g, h in zip(grads, a[1]))             # in place
    assert all(bool((g == 0).all()) for g in a[1]) and any(bool(g.ne(0).any()) for g in b[1])
    for x, y in zip(a[0] + a[2] + a[3], b[0] + b[2] + b[3]):     # the update read them first
        assert torch.equal(x, y)
    with pytest.raises(ValueError, match=r"grads\[0\] must be contiguous with zero_grads=True"):
        tk.adamw_step([torch.zeros(4, 3)], [torch.zeros(3, 4).t()], [torch.zeros(4, 3)], [torch.zeros(4, 3)],
                      [torch.tensor(0.0)], lr=1e-3, zero_grads=True, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_grads_and_shapes(backend):
    gen = torch.Generator().manual_seed(41)
    shapes = [(300, 257), (4, 5, 6), (1,)]
    p = [torch.randn(*s, generator=gen) * 0.05 for s in shapes]
    g = [torch.randn(257, 300, generator=gen).t(), torch.randn(6, 5, 4, generator=gen).permute(2, 1, 0),
         torch.randn(3, generator=gen)[1:2]]
    assert not g[0].is_contiguous()
    m = [torch.zeros_like(x) for x in p]
    v = [torch.zeros_like(x) for x in p]
    steps = [torch.tensor(0.0) for _ in p]
    want = [_float64_step(p[k], g[k], m[k], v[k], 1.0, grad_factor=1.0, **HYPER) for k in range(3)]
    tk.adamw_step(p, g, m, v, steps, backend=backend, **HYPER)
    for k in range(3):
        assert_close(p[k], want[k][0], torch.float32, name=f"params[{k}]")


@needs_cpp
def test_thread_count_does_not_change_the_result():
    a = _state([3 * 32768 + 5, 200001], 51)
    b = tuple([x.clone() for x in xs] for xs in a)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        tk.adamw_step(*a, backend="cpu", **HYPER)
        torch.set_num_threads(max(2, threads))
        tk.adamw_step(*b, backend="cpu", **HYPER)
    finally:
        torch.set_num_threads(threads)
    for x, y in zip(a[0] + a[2] + a[3], b[0] + b[2] + b[3]):
        assert torch.equal(x, y)


def test_empty_list_is_a_no_op():
    tk.adamw_step([], [], [], [], [], lr=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mutate,error,match", [
    (lambda s: s[2].__setitem__(1, s[2][1].bfloat16()), TypeError, r"exp_avgs\[1\] must be float32"),
    (lambda s: s[0].__setitem__(1, torch.randn(40, 25).t()), ValueError, r"params\[1\] must be contiguous"),
    (lambda s: s[3].__setitem__(1, torch.zeros(999)), ValueError, r"exp_avg_sqs\[1\] has shape"),
    (lambda s: s[1].__setitem__(1, torch.zeros(999)), ValueError, r"grads\[1\] has shape"),
    (lambda s: s[1].__setitem__(1, torch.zeros(1000, dtype=torch.float64)), TypeError, r"grads\[1\] has dtype"),
    (lambda s: s[4].__setitem__(1, torch.tensor(1)), TypeError, r"steps\[1\] must be a one-element float32"),
    (lambda s: s[1].pop(), ValueError, r"grads has 1 tensors but params has 2"),
])
def test_bad_input_names_the_argument_and_writes_nothing(backend, mutate, error, match):
    s = _state([7, 1000], 61)
    mutate(s)
    before = [x.clone() for xs in s for x in xs]
    with pytest.raises(error, match=match):
        tk.adamw_step(*s, backend=backend, **HYPER)
    assert all(torch.equal(x, y) for x, y in zip([x for xs in s for x in xs], before))


@pytest.mark.parametrize("kw,error,match", [
    (dict(lr=-1.0), ValueError, "lr must be >= 0"),
    (dict(lr=float("nan")), ValueError, "lr must be finite"),
    (dict(betas=(1.0, 0.9)), ValueError, r"betas\[0\] must be in \[0, 1\)"),
    (dict(betas=0.9), TypeError, "betas must be a pair"),
    (dict(eps=0.0), ValueError, "eps must be a positive"),
    (dict(weight_decay=-0.1), ValueError, "weight_decay must be >= 0"),
    (dict(grad_factor=float("inf")), ValueError, "grad_factor must be finite"),
])
def test_bad_hyperparameters_name_the_argument(kw, error, match):
    s = _state([7], 71)
    with pytest.raises(error, match=match):
        tk.adamw_step(*s, **{**dict(lr=1e-3), **kw})


def test_out_params_checked():
    s = _state([7], 81)
    with pytest.raises(TypeError, match=r"out_params\[0\] has dtype torch.float64"):
        tk.adamw_step(*s, lr=1e-3, out_params=[torch.zeros(7, dtype=torch.float64)])
    with pytest.raises(ValueError, match=r"out_params\[0\] must be contiguous"):
        tk.adamw_step(*s, lr=1e-3, out_params=[torch.zeros(7, 2)[:, 0]])
    with pytest.raises(TypeError, match="out_params must be a list"):
        tk.adamw_step(*s, lr=1e-3, out_params=torch.zeros(7))
