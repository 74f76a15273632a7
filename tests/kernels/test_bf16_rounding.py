"""The C++ kernels' bfloat16 loads and stores, bit for bit against torch's own fp32 -> bf16 rounding.

The SwiGLU kernels convert with their own code on AVX-512 (``csrc/common/vec.h``: ``load2_ew`` /
``store2_ew``), so the rounding is checked here exactly, not within a tolerance: round to nearest with
ties to even, subnormals, infinities (including finite values that round past the largest bf16) and
NaNs, over every bf16 bit pattern as an input, on every ISA build this CPU runs.

How the rounding is isolated: with ``gate >= 17``, ``1 + exp(-gate)`` rounds to 1 in fp32, so
``sigmoid(gate)`` is exactly 1 and ``silu(gate) == gate``; SiLU's derivative is then exactly 1. The
kernels' fp32 results are then plain products of two bf16 values (``gate * up``, ``dy * gate``,
``dy * up``), which fp32 holds exactly unless they underflow, where torch's multiplication rounds
the same way. So each stored value must equal torch's ``(a.float() * b.float()).bfloat16()``.
"""
import pytest
import torch

from twinkle_kernels import _cpu_ext

pytestmark = pytest.mark.skipif(_cpu_ext.unavailable_reason() is not None,
                                reason=f"C++ extension not built: {_cpu_ext.unavailable_reason()}")


def _ops(variant):
    """The raw ops of one ISA build, or a skip saying why it cannot load here."""
    try:
        return _cpu_ext.load(variant)
    except Exception as e:  # not built here: test_cpu_kernels' test_isa_builds_agree reports those
        pytest.skip(f"the {variant} build does not load: {type(e).__name__}: {e}")


VARIANTS = list(_cpu_ext.cpu_supports())


def _all_bf16_patterns(gen, rows, cols):
    """Random bf16 bit patterns (every class: zeros, subnormals, normals, inf, NaN), every pattern once."""
    n = rows * cols
    bits = torch.cat([torch.arange(-32768, 32768, dtype=torch.int32),
                      torch.randint(-32768, 32768, (max(0, n - 65536),), generator=gen, dtype=torch.int32)])
    bits = bits[torch.randperm(bits.numel(), generator=gen)][:n]
    return bits.to(torch.int16).view(torch.bfloat16).view(rows, cols)


def _large_gates(gen, rows, cols):
    """bf16 gates in [17, 4096): sigmoid(gate) == 1 in fp32."""
    g = torch.exp(torch.empty(rows, cols).uniform_(17.0 ** 0.5, 4096.0 ** 0.5, generator=gen).log() * 2)
    g = g.to(torch.bfloat16)
    return torch.where(g < 17, torch.full_like(g, 17.0), g)


def _assert_bits_equal(got, want, what):
    gn, wn = torch.isnan(got), torch.isnan(want)
    assert torch.equal(gn, wn), f"{what}: NaN at {torch.nonzero(gn != wn)[:5].tolist()}"
    gb, wb = got.view(torch.int16), want.view(torch.int16)
    bad = (gb != wb) & ~wn
    assert not bad.any(), (f"{what}: {int(bad.sum())} values differ from torch's rounding, e.g. "
                           f"got {got[bad][:4].tolist()} want {want[bad][:4].tolist()}")


def _coverage(a, b):
    """What the products a * b exercise: ties both ways, subnormal results, rounding up to inf."""
    p = a.float() * b.float()
    bits = p.view(torch.int32)
    finite = torch.isfinite(p)
    tie = finite & ((bits & 0xFFFF) == 0x8000)
    odd = (bits & 0x10000) != 0
    return {"tie, even kept part": int((tie & ~odd).sum()), "tie, odd kept part": int((tie & odd).sum()),
            "subnormal": int((finite & (p != 0) & (p.abs() < torch.finfo(torch.float32).tiny)).sum()),
            "finite rounds to inf": int((finite & torch.isinf(p.bfloat16())).sum()),
            "nan": int(torch.isnan(p).sum())}


@pytest.mark.parametrize("cols", [4096, 1000, 31])
@pytest.mark.parametrize("variant", VARIANTS)
def test_swiglu_bf16_rounding_is_torchs(variant, cols):
    ops = _ops(variant)
    gen = torch.Generator().manual_seed(cols)
    rows = max(1, 70000 // cols)
    gate = _large_gates(gen, rows, cols)
    up = _all_bf16_patterns(gen, rows, cols)
    dy = _all_bf16_patterns(gen, rows, cols)
    # Products that are finite in fp32 but round to +-inf in bf16: 1.75 * 1.140625 = 2 - 2^-8, a tie
    # above the largest bf16 (2 - 2^-7) * 2^127 whose kept part is odd. Random patterns rarely land there.
    big = 1.140625 * 2.0 ** 127
    gate[0, :4] = torch.tensor([28.0, 28.0, big, big])
    up[0, :4] = torch.tensor([big / 16, -big / 16, big, -big])
    dy[0, :4] = torch.tensor([1.75, -1.75, 1.75, -1.75])
    if cols == 4096:  # the inputs reach every case the rounding has (asserted so the test cannot pass vacuously)
        for pair, (a, b) in {"gate * up": (gate, up), "dy * gate": (dy, gate), "dy * up": (dy, up)}.items():
            for name, count in _coverage(a, b).items():
                if pair == "dy * gate" and name in ("subnormal", "nan"):
                    continue  # gate >= 17: those come from dy alone, covered by the other pairs
                assert count > 0, f"the test inputs have no {pair} product that is a {name}"

    # outputs are views into wider buffers whose padding must survive: the tail stores are masked
    def out():
        buf = torch.full((rows, cols + 40), 7.0, dtype=torch.bfloat16)
        return buf, buf[:, 3:3 + cols]

    (yb, y), (dgb, dg), (dub, du) = out(), out(), out()
    ops.swiglu_fwd(gate, up, y, 0)
    ops.swiglu_bwd(dy, gate, up, dg, du, 0)
    _assert_bits_equal(y, (gate.float() * up.float()).bfloat16(), f"{variant} swiglu_fwd")
    _assert_bits_equal(du, (dy.float() * gate.float()).bfloat16(), f"{variant} swiglu_bwd dup")
    _assert_bits_equal(dg, (dy.float() * up.float()).bfloat16(), f"{variant} swiglu_bwd dgate")
    for name, buf in (("out", yb), ("dgate", dgb), ("dup", dub)):
        pad = torch.cat([buf[:, :3], buf[:, 3 + cols:]], 1)
        assert (pad == 7.0).all(), f"{variant}: {name} written outside its [rows, cols] view"


@pytest.mark.parametrize("variant", VARIANTS)
def test_swiglu_bf16_loads_every_pattern(variant):
    """bf16 -> fp32 is exact for every bit pattern: silu(gate) * 1 with gate's every pattern >= 17."""
    ops = _ops(variant)
    bits = torch.arange(0x4188, 0x7F80, dtype=torch.int32).to(torch.int16)   # 17.0 up to the largest finite bf16
    gate = bits.view(torch.bfloat16)
    cols = 1024
    gate = torch.cat([gate, gate[: (-gate.numel()) % cols]]).view(-1, cols)
    up = torch.ones_like(gate)
    y = torch.empty_like(gate)
    ops.swiglu_fwd(gate, up, y, 0)
    _assert_bits_equal(y, gate, f"{variant} swiglu_fwd(gate, 1)")
