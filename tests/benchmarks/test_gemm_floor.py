"""benchmarks/harness/gemm_floor.py: a step's matrix products recorded (forward and backward, the
dtypes autocast ran them in, integer offsets by value) and replayed. Timings are never checked,
only what was recorded and counted."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.harness import gemm_floor


def _linear_step(x, w, b):
    y = torch.nn.functional.linear(x, w, b)
    y.square().sum().backward()


def test_a_linear_layers_three_products_are_recorded_and_counted():
    x = torch.randn(5, 7, requires_grad=True)
    w = torch.randn(3, 7, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    _, rec = gemm_floor.record(lambda: [_linear_step(x, w, b) for _ in range(2)])
    # forward addmm, backward mm for the input's and the weight's gradients; twice
    assert rec.count == 6
    ops = sorted(c[0].overloadpacket.__name__ for c in rec.calls.values())
    assert ops == ["addmm", "mm", "mm"], ops
    assert all(c[3] == 2 for c in rec.calls.values())
    out = gemm_floor.replay(rec, reps=1)
    assert out["calls"] == 6 and out["distinct"] == 3
    assert out["flops"] == 2 * 3 * (2 * 5 * 7 * 3)
    assert out["seconds"] > 0
    assert {r[3] for r in out["rows"]} == {2}
    assert sorted(tuple(tuple(s) for s in r[1][-2:]) for r in out["rows"]) == sorted(
        [((5, 7), (7, 3)), ((5, 3), (3, 7)), ((3, 5), (5, 7))])


def test_the_replayed_flops_equal_torchs_count_of_the_step():
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.GELU(), torch.nn.Linear(33, 16, bias=False))
    x = torch.randn(4, 9, 16)

    def step():
        layer(x).sum().backward()

    counter = FlopCounterMode(display=False)
    with counter:
        step()
    _, rec = gemm_floor.record(step)
    assert gemm_floor.replay(rec, reps=1)["flops"] == counter.get_total_flops()


def test_autocast_products_are_recorded_in_bf16():
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = x @ w
        y.float().sum().backward()

    _, rec = gemm_floor.record(step)
    out = gemm_floor.replay(rec, reps=1)
    assert {r[2] for r in out["rows"]} == {"bfloat16"}, out["rows"]


def test_other_ops_are_not_recorded_and_an_empty_step_is_zero():
    x = torch.randn(6, 6)
    _, rec = gemm_floor.record(lambda: (x * 2).relu().sum())
    assert rec.count == 0
    assert gemm_floor.replay(rec) == {"seconds": 0.0, "flops": 0, "calls": 0, "distinct": 0, "rows": []}


def test_strides_are_kept():
    """A transposed operand is replayed transposed (a GEMM's layout changes its time)."""
    a = torch.randn(7, 5).t()
    b = torch.randn(7, 3)
    _, rec = gemm_floor.record(lambda: torch.mm(a, b))
    (func, args, kwargs, count), = rec.calls.values()
    assert args[0].stride == (1, 5) and args[1].stride == (3, 1)
    assert gemm_floor._build(args[0], "cpu").stride() == (1, 5)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="no torch._grouped_mm in this torch")
def test_grouped_mm_offsets_are_kept_by_value():
    a = torch.randn(10, 16, dtype=torch.bfloat16)
    b = torch.randn(3, 16, 8, dtype=torch.bfloat16)
    offs = torch.tensor([2, 2, 10], dtype=torch.int32)
    try:
        torch._grouped_mm(a, b, offs=offs)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._grouped_mm does not run here: {e}")
    _, rec = gemm_floor.record(lambda: torch._grouped_mm(a, b, offs=offs))
    (func, args, kwargs, count), = rec.calls.values()
    ints = [x for x in list(args) + list(kwargs.values()) if getattr(x, "value", None) is not None]
    assert len(ints) == 1 and torch.equal(ints[0].value, offs)
    out = gemm_floor.replay(rec, reps=1)
    assert out["calls"] == 1 and out["rows"][0][0] == "_grouped_mm"
    assert out["flops"] == 2 * 10 * 16 * 8   # every row of a, through one expert each
    # the weight-gradient form [K, M] x [M, N] (ragged M), the offsets covering 6 of the 16 rows
    a2, b2 = torch.randn(16, 16, dtype=torch.bfloat16), torch.randn(16, 8, dtype=torch.bfloat16)
    offs2 = torch.tensor([2, 4, 6], dtype=torch.int32)
    _, rec = gemm_floor.record(lambda: torch._grouped_mm(a2, b2, offs=offs2))
    assert gemm_floor.replay(rec, reps=1)["flops"] == 2 * 16 * 6 * 8
