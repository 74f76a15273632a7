"""``twinkle_kernels.sum_of_squares`` (the float64 squared norm of many tensors) against an
independent float64 sum, on the C++ backend (``backend="cpu"``: a silent fallback would raise) and
the reference: sizes around the C++ loops' vector blocks (float: 32 elements on AVX-512, 16 on AVX2;
the other dtypes: 16 lanes) and 65536-element ranges, every input dtype,
non-contiguous inputs, values whose squares leave float32's range, thread-count independence,
and bad input."""
import math

import pytest
import torch

import twinkle_kernels as tk
from twinkle_kernels import _cpu_ext
from twinkle_kernels.sum_squares import sum_of_squares_reference

needs_cpp = pytest.mark.skipif(_cpu_ext.unavailable_reason() is not None,
                               reason=f"C++ extension not built: {_cpu_ext.unavailable_reason()}")
BACKENDS = [pytest.param("cpu", marks=needs_cpp), "reference"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
SIZES = [0, 1, 15, 16, 17, 31, 32, 33, 47, 1000, 65535, 65536, 65537, 3 * 65536 + 5]


def _exact(tensors):
    """The sum of squares with Python's correctly rounded float sum (each square exact in float64
    for these inputs' 24-bit or narrower mantissas)."""
    return math.fsum(v * v for t in tensors for v in t.detach().double().reshape(-1).tolist())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_equals_the_exact_sum(backend, dtype):
    g = torch.Generator().manual_seed(SIZES.index(65537) + DTYPES.index(dtype))
    tensors = [(torch.randn(n, generator=g) * 3).to(dtype) for n in SIZES]
    got = tk.sum_of_squares(tensors, backend=backend)
    assert got.dtype == torch.float64 and got.shape == () and got.device.type == "cpu"
    exact = _exact(tensors)
    assert abs(float(got) - exact) <= 1e-13 * exact, (float(got), exact)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_dtypes_non_contiguous_and_shapes(backend):
    g = torch.Generator().manual_seed(7)
    base = torch.randn(300, 257, generator=g)
    tensors = [base.t(), base[::3, 1::2], torch.randn(2, 3, 4, generator=g).bfloat16().transpose(0, 2),
               torch.randn(5, generator=g).half(), torch.randn(9, 9, generator=g).double()[:, 2],
               torch.randn(0, 4, generator=g)]
    assert not tensors[0].is_contiguous() and not tensors[1].is_contiguous()
    exact = _exact(tensors)
    assert abs(float(tk.sum_of_squares(tensors, backend=backend)) - exact) <= 1e-13 * exact


@pytest.mark.parametrize("backend", BACKENDS)
def test_squares_outside_float32s_range(backend):
    # 1e20 ** 2 overflows float32, 1e-25 ** 2 underflows it: both are float64 values
    big = torch.full((33,), 1e20)
    tiny = torch.full((70000,), 1e-25)
    got = tk.sum_of_squares([big], backend=backend)
    assert math.isfinite(float(got)) and abs(float(got) - _exact([big])) <= 1e-13 * _exact([big])
    got = tk.sum_of_squares([tiny], backend=backend)
    assert float(got) > 0 and abs(float(got) - _exact([tiny])) <= 1e-12 * _exact([tiny])


@needs_cpp
def test_cpu_result_does_not_depend_on_the_thread_count():
    x = [torch.randn(5 * 65536 + 3, generator=torch.Generator().manual_seed(3))]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = tk.sum_of_squares(x, backend="cpu")
        torch.set_num_threads(max(2, threads))
        many = tk.sum_of_squares(x, backend="cpu")
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def test_reference_is_the_documented_sum():
    x = [torch.tensor([3.0, 4.0]), torch.tensor([[12.0]], dtype=torch.float64)]
    assert float(sum_of_squares_reference(x)) == 169.0 == float(tk.sum_of_squares(x))


def test_empty_and_detached():
    assert float(tk.sum_of_squares([])) == 0.0 and tk.sum_of_squares(()).dtype == torch.float64
    w = torch.ones(4, requires_grad=True)
    got = tk.sum_of_squares([w * 2])
    assert float(got) == 16.0 and not got.requires_grad


@pytest.mark.parametrize("tensors, error, words", [
    (torch.ones(3), TypeError, ["tensors", "list or tuple"]),
    ((t for t in [torch.ones(3)]), TypeError, ["tensors", "list or tuple"]),
    ([torch.ones(3), [1.0]], TypeError, ["tensors[1]"]),
    ([torch.ones(3), torch.ones(3, dtype=torch.int64)], TypeError, ["tensors[1]", "int64"]),
    ([torch.ones(3, dtype=torch.complex64)], TypeError, ["tensors[0]", "complex64"]),
    ([torch.ones(3), torch.ones(3, device="meta")], ValueError, ["tensors[0]", "tensors[1]"]),
])
def test_bad_input_names_the_argument(tensors, error, words):
    with pytest.raises(error) as info:
        tk.sum_of_squares(tensors)
    assert all(w in str(info.value) for w in words), str(info.value)
