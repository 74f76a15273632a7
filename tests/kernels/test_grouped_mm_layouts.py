"""The C++ grouped matmul's forward on every weight layout and group size, against a float64 loop.

``grouped_mm_fwd`` computes a group of few rows against a transposed-stored fp32 weight (the
Megatron / Hugging Face expert layout) as ``(w[e]^T x^T)^T`` through a scratch buffer and a
transposed copy, and every other case as ``x @ w[e]``; the switch depends on the rows per group
(``kSwapRows`` in ``csrc/moe/grouped_mm.cpp``), so the groups here straddle it. Outputs start as
NaN, so a row the op forgets to write fails.
"""
import pytest
import torch

from twinkle_kernels import _cpu_ext

pytestmark = pytest.mark.skipif(_cpu_ext.unavailable_reason() is not None,
                                reason=f"C++ extension not built: {_cpu_ext.unavailable_reason()}")

# rows per group: empty, one, below / at / above the swap threshold (48), a large one
COUNTS = [0, 1, 5, 31, 47, 48, 49, 0, 130, 17]


def _weight(layout, e, k, n, dtype, gen):
    if layout == "contiguous":          # [E, K, N] row-major: dx's w^T views of a [E, N, K] weight
        return torch.randn(e, k, n, generator=gen).to(dtype)
    if layout == "transposed":          # [E, K, N] view of [E, N, K]: the forward of the expert layouts
        return torch.randn(e, n, k, generator=gen).to(dtype).transpose(1, 2)
    if layout == "strided":             # neither: every other column of a wider weight
        return torch.randn(e, k, 2 * n, generator=gen).to(dtype)[:, :, ::2]
    raise ValueError(layout)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided"])
@pytest.mark.parametrize("threads", [1, 2])
def test_grouped_mm_fwd_layouts(layout, dtype, threads):
    gen = torch.Generator().manual_seed(7)
    k, n = 96, 80
    counts = torch.tensor(COUNTS)
    m = int(counts.sum())
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = _weight(layout, len(COUNTS), k, n, dtype, gen)
    out = torch.full((m, n), float("nan"), dtype=dtype)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _cpu_ext.ops().grouped_mm_fwd(x, w, offsets, out)
    finally:
        torch.set_num_threads(prev)
    ref = torch.empty(m, n, dtype=torch.float64)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        ref[start:end] = x[start:end].double() @ w[e].double()
        start = end
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    err = ((out.double() - ref).abs() / (ref.abs() + 1)).max().item()
    assert not torch.isnan(out).any(), "rows left unwritten"
    assert err < tol, f"{layout} {dtype}: max error {err:.3g}"
