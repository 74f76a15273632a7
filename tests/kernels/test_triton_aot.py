"""The compile lane (``python -m twinkle_kernels._triton_aot``): launches are recorded from real
calls, compiled for sm_80 and sm_90 in a process without ``TRITON_INTERPRET``, and the lane fails
on a shared-memory overflow while passing launches that fit."""
import json
import os
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

import twinkle_kernels as tk  # noqa: E402
from twinkle_kernels._triton_aot import record  # noqa: E402

# not conftest.ROOT: the compile lane imports this module (HERE on its path) in a process without conftest
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs a GPU or the Triton interpreter to record launches")


@triton.jit(do_not_specialize=["n_rows"])
def _dot_tile_kernel(a_ptr, b_ptr, c_ptr, n_rows, K, scale, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """c[:BM, :BN] = scale * a[:BM, :K] @ b[:K, :BN] (row-major, contiguous); its shared memory is
    num_stages * (BM + BN) * BK operand elements."""
    rm = tl.arange(0, BM)
    rn = tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        a = tl.load(a_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < n_rows) & (rk[None, :] < K), other=0.0)
        b = tl.load(b_ptr + rk[:, None] * BN + rn[None, :], mask=rk[:, None] < K, other=0.0)
        acc = tl.dot(a, b, acc)
    tl.store(c_ptr + rm[:, None] * BN + rn[None, :], acc * scale, mask=rm[:, None] < n_rows)


def _launch_tile(dtype, bm, bn, bk, k, stages, n_rows=None):
    a = torch.randn(bm, k, device=DEVICE).to(dtype)
    b = torch.randn(k, bn, device=DEVICE).to(dtype)
    c = torch.full((bm, bn), float("nan"), device=DEVICE)
    _dot_tile_kernel[(1,)](a, b, c, bm if n_rows is None else n_rows, k, 0.5, BM=bm, BN=bn, BK=bk,
                           num_warps=4, num_stages=stages)
    return a, b, c


def test_recording_describes_a_launch_as_the_compiler_sees_it():
    with record.recording() as rec:
        a, b, c = _launch_tile(torch.float32, 16, 16, 16, 48, stages=2)
    # the kernel ran (recording only observes)
    torch.testing.assert_close(c, 0.5 * (a.double() @ b.double()).float(), atol=1e-4, rtol=1e-4)
    (launch,) = rec.launches
    assert launch.kernel == f"{__name__}:_dot_tile_kernel"
    assert launch.constexprs == {"BM": 16, "BN": 16, "BK": 16}
    assert launch.options == {"num_warps": 4, "num_stages": 2}
    sig = dict(launch.signature)
    assert sig["a_ptr"] == sig["b_ptr"] == sig["c_ptr"] == "*fp32"
    assert sig["scale"] == "fp32"
    assert sig["n_rows"] == "i32" and "n_rows" not in launch.attrs     # do_not_specialize: not 16-divisible
    assert sig["K"] == "i32" and launch.attrs["K"] == "D"                # 48 % 16 == 0
    assert launch.attrs["a_ptr"] == "D"                                  # torch allocations are 16-aligned


def test_recording_dedups_and_folds_as_the_launcher_does():
    with record.recording(execute=False) as rec:
        for k in (32, 48):                  # same compiled kernel: both divisible by 16
            _launch_tile(torch.float16, 16, 16, 16, k, stages=2)
        _launch_tile(torch.float16, 16, 16, 16, 40, stages=2)      # not divisible: another one
        _launch_tile(torch.float16, 16, 16, 16, 1, stages=2)       # K == 1 becomes a constant
    launches = rec.launches
    assert len(launches) == 3
    assert [lc.attrs.get("K") for lc in launches[:2]] == ["D", None]
    assert launches[2].folded == {"K": 1} and dict(launches[2].signature)["K"] == "constexpr"
    assert all(dict(lc.signature)["a_ptr"] == "*fp16" for lc in launches)


def test_record_only_skips_the_kernel():
    with record.recording(execute=False) as rec:
        _, _, c = _launch_tile(torch.float32, 16, 16, 16, 16, stages=1)
    assert len(rec.launches) == 1 and torch.isnan(c).all()


def test_recording_captures_a_public_op_in_bf16():
    """bf16 calls are recorded as bf16 launches (record-only: the interpreter's bf16 math is wrong)."""
    x = torch.randn(6, 96, dtype=torch.bfloat16, device=DEVICE)
    w = torch.randn(96, dtype=torch.bfloat16, device=DEVICE)
    with record.recording(execute=False) as rec:
        tk.rms_norm(x, w, backend="triton")
    norm = [lc for lc in rec.launches if lc.kernel.startswith("twinkle_kernels.norm.")]
    assert len(norm) == 1, rec.launches
    assert "*bf16" in dict(norm[0].signature).values()
    # a row of 96 is one power-of-two block
    assert 128 in norm[0].constexprs.values(), norm[0].constexprs


@pytest.mark.skipif(DEVICE == "cuda", reason="the table records CPU tensors under the interpreter")
def test_model_table_records_the_delta_rule_at_qwen3_5_widths():
    from twinkle_kernels._triton_aot import shapes
    launches = shapes.record_table(["qwen3_5"], ["bf16"], ["gated_delta_rule"])
    names = {lc.name for lc in launches}
    assert len(names) >= 5, names       # chunked fwd + bwd, conv fwd + bwd, fused recurrent
    assert all("qwen3_5/bf16/gated_delta_rule" in lc.tags for lc in launches)
    # q/k/v stay bf16 in the launches that read them
    assert sum("*bf16" in dict(lc.signature).values() for lc in launches) >= 5


def _lane(tmp_path, launches, *extra):
    # imported here: the lane imports this module to find _dot_tile_kernel, and conftest turns
    # the interpreter on when it is imported
    from conftest import run_in_own_group
    path = tmp_path / "launches.jsonl"
    record.write_jsonl(str(path), launches)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([HERE, ROOT, env.get("PYTHONPATH", "")])
    return run_in_own_group([sys.executable, "-m", "twinkle_kernels._triton_aot", "--no-table", "--jobs", "1",
                             "--launches", str(path), *extra], env=env, timeout=300, what="the compile lane")


def test_lane_compiles_fitting_launches_and_fails_on_shared_memory_overflow(tmp_path):
    x = torch.randn(6, 96, dtype=torch.bfloat16, device=DEVICE)
    w = torch.randn(96, dtype=torch.bfloat16, device=DEVICE)
    with record.recording(execute=False) as rec:
        _launch_tile(torch.float16, 64, 64, 32, 128, stages=2)   # 2 * (64 + 64) * 32 * 2 B = 16 KB
        tk.rms_norm(x, w, backend="triton")                       # a real op's launch
    fitting = rec.launches
    with record.recording(execute=False) as rec:
        # 4 stages * (256 + 256) * 64 * 2 B = 256 KB: over sm_80's 166,912 B and sm_90's 232,448 B
        _launch_tile(torch.float16, 256, 256, 64, 256, stages=4)
    (oversized,) = rec.launches

    rc, out = _lane(tmp_path, fitting, "--arch", "80,90", "--markdown", str(tmp_path / "r.md"))
    assert rc == 0, out
    ok = [line for line in out.splitlines() if line.startswith("ok ")]
    assert len(ok) == 2 * len(fitting), out
    assert any("sm_80 _dot_tile_kernel [fp16,fp32] BM=64 BN=64 BK=32 w4 s2: REG" in line for line in ok), out
    assert "0 failure(s)" in out
    md = (tmp_path / "r.md").read_text()
    assert "| _dot_tile_kernel | sm_90 |" in md

    rc, out = _lane(tmp_path, fitting + [oversized], "--arch", "80,90")
    assert rc == 1, out
    over = [line for line in out.splitlines() if line.startswith("FAILED: shared memory")]
    assert len(over) == 2 and "> 166,912 B" in over[0] + over[1] and "> 232,448 B" in over[0] + over[1], out
    assert "BM=256 BN=256 BK=64" in over[0]
    assert "2 failure(s)" in out


def test_lane_compiles_every_glu_activation_without_spills(tmp_path):
    """The swiglu kernels' ACT constexpr (silu, gelu, gelu_tanh), forward and backward, bf16 and fp32,
    a one-block row and a row of full 1024-column blocks: all compile for sm_80 and sm_90 with no stack."""
    with record.recording(execute=False) as rec:
        for act in ("silu", "gelu", "gelu_tanh"):
            for dtype in (torch.bfloat16, torch.float32):
                for n in (48, 4096):
                    g = torch.randn(4, n, device=DEVICE, dtype=dtype, requires_grad=True)
                    tk.swiglu(g, g.detach().clone(), activation=act, backend="triton").sum().backward()
                    x = torch.randn(4, 2 * n, device=DEVICE, dtype=dtype, requires_grad=True)
                    tk.swiglu_packed(x, activation=act, backend="triton").sum().backward()
    launches = [lc for lc in rec.launches if lc.kernel.startswith("twinkle_kernels.swiglu.")]
    assert {lc.constexprs["ACT"] for lc in launches} == {0, 1, 2}, [lc.constexprs for lc in launches]
    assert {lc.kernel.rsplit(":", 1)[-1] for lc in launches} == {"_swiglu_fwd_kernel", "_swiglu_bwd_kernel"}
    rc, out = _lane(tmp_path, launches, "--arch", "80,90", "--max-stack", "0")
    assert rc == 0, out
    ok = [line for line in out.splitlines() if line.startswith("ok ")]
    assert len(ok) == 2 * len(launches), out
    assert all(" STACK 0 " in line for line in ok), out
    assert {f"ACT={a}" for a in (0, 1, 2)} <= {w for line in ok for w in line.split()}, out
    assert "0 failure(s)" in out, out


def test_lane_reports_a_compile_error(tmp_path):
    with record.recording(execute=False) as rec:
        _launch_tile(torch.float32, 16, 16, 16, 16, stages=1)
    (launch,) = rec.launches
    bad = record.Launch.from_json(json.loads(json.dumps(launch.to_json())))
    bad.constexprs["BM"] = 12        # tl.arange needs a power of two
    rc, out = _lane(tmp_path, [bad], "--arch", "90")
    assert rc == 1, out
    assert "FAIL sm_90 _dot_tile_kernel" in out and "FAILED: compile error" in out, out


def test_subsets_keep_the_largest_tile_of_each_path():
    from twinkle_kernels._triton_aot.__main__ import _subset
    with record.recording(execute=False) as rec:
        _launch_tile(torch.float16, 16, 16, 16, 32, stages=2)
        _launch_tile(torch.float16, 32, 32, 16, 32, stages=2)     # same path, larger tile
        _launch_tile(torch.float32, 16, 16, 16, 32, stages=2)     # another dtype: another path
    small16, big16, small32 = rec.launches
    paths = _subset(rec.launches, "paths")
    assert [lc.key() for lc in paths] == [big16.key(), small32.key()]
    assert [lc.key() for lc in _subset(rec.launches, "kernel")] == [big16.key()]
    assert _subset(rec.launches, "all") == rec.launches


def test_compare_markdown_shows_before_and_after():
    from twinkle_kernels._triton_aot import report
    from twinkle_kernels._triton_aot.compile import Result
    with record.recording(execute=False) as rec:
        _launch_tile(torch.float16, 16, 16, 16, 32, stages=2)
    (launch,) = rec.launches
    before = [(launch, [Result(90, regs=255, stack=640, shared=1000, num_warps=4, num_stages=2)])]
    after = [(launch, [Result(90, regs=96, stack=0, shared=1000, num_warps=4, num_stages=2)])]
    md = report.compare_markdown(before, after)
    assert "| _dot_tile_kernel | sm_90 | fp16 | 1 | 255 -> 96 | 640 -> 0 | 1 -> 0 | 1,000 |" in md, md


@pytest.mark.skipif(DEVICE == "cuda", reason="the table records CPU tensors under the interpreter")
def test_model_table_records_gpu_launch_configurations():
    """The table records what a GPU would launch, not the interpreter's smaller choices: the fused
    cross-entropy walks the vocabulary in 4096-wide blocks on a GPU (1024 on CPU tensors)."""
    from twinkle_kernels._triton_aot import shapes
    launches = shapes.record_table(["llama3_8b"], ["bf16"], ["fused_linear_cross_entropy"])
    blocks = {lc.constexprs.get("BLOCK") for lc in launches if lc.kernel.startswith("twinkle_kernels.linear_ce.")}
    assert blocks == {4096}, [(lc.name, lc.constexprs) for lc in launches]


def test_subset_leaves_out_paths_compiled_anyway():
    from twinkle_kernels._triton_aot.__main__ import _subset
    with record.recording(execute=False) as rec:
        _launch_tile(torch.float16, 16, 16, 16, 32, stages=2)
        _launch_tile(torch.float32, 16, 16, 16, 32, stages=2)
    fp16, fp32 = rec.launches
    with record.recording(execute=False) as rec:
        _launch_tile(torch.float16, 32, 32, 16, 32, stages=2)   # the table's fp16 path, another tile
    assert [lc.key() for lc in _subset([fp16, fp32], "paths", covered=rec.launches)] == [fp32.key()]


def test_nested_recorders_keep_their_launches():
    """A test's own recording (e.g. the oversized launch above) stays out of an outer one (the
    session's, which the compile lane compiles in CI)."""
    with record.recording() as outer:
        _launch_tile(torch.float32, 16, 16, 16, 16, stages=1)
        with record.recording(execute=False) as inner:
            _launch_tile(torch.float16, 16, 16, 16, 16, stages=1)
    assert [record.pointer_dtypes(lc) for lc in outer.launches] == ["fp32"]
    assert [record.pointer_dtypes(lc) for lc in inner.launches] == ["fp16,fp32"]


@pytest.mark.skipif(DEVICE == "cuda", reason="runs the rms_norm tests under the interpreter")
def test_pytest_option_records_the_session(tmp_path):
    """What CI does: the suite runs with --triton-launches (TWINKLE_TRITON_LAUNCHES) and the lane
    compiles the file."""
    from conftest import run_in_own_group
    out = tmp_path / "suite.jsonl"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
               TWINKLE_TRITON_LAUNCHES=str(out))
    rc, log = run_in_own_group([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                "tests/kernels/test_rowwise.py", "-k", "test_rms_norm and 4x33-contiguous-0.0-fp32-triton"],
                               env=env, timeout=300, what="pytest with launch recording")
    assert rc == 0, log
    launches = record.read_jsonl(str(out))
    assert launches and all(lc.kernel.startswith("twinkle_kernels.norm.") for lc in launches), launches
    assert any(t.startswith("tests/kernels/test_rowwise.py::test_rms_norm[") for lc in launches for t in lc.tags)


def test_stack_overview_counts_compiles_with_stack():
    from twinkle_kernels._triton_aot import report
    from twinkle_kernels._triton_aot.compile import Result
    with record.recording(execute=False) as rec:
        _launch_tile(torch.float16, 16, 16, 16, 32, stages=2)
        _launch_tile(torch.float16, 32, 32, 16, 32, stages=2)
    a, b = rec.launches
    before = [(a, [Result(90, 255, 640, 10, 4, 2)]), (b, [Result(90, 255, 8, 10, 4, 2)])]
    after = [(a, [Result(90, 96, 0, 10, 4, 2)]), (b, [Result(90, 200, 16, 10, 4, 2)])]
    assert "| sm_90 | fp16 | 2 | 2 -> 1 | _dot_tile_kernel |" in report.stack_overview(before, after)


def test_a_compiled_kernel_is_described_as_the_interpreted_one():
    """On a GPU the recorder sees JITFunction launches, here InterpretedFunction ones: same record."""
    snippet = (
        "import json, torch\n"
        "from twinkle_kernels._triton_aot.record import describe\n"
        "from twinkle_kernels.norm import _triton as m\n"
        "x = torch.zeros(8, 96); w = torch.zeros(96); r = torch.zeros(8)\n"
        "k = m._norm_fwd_kernel\n"
        "launch = describe(k, (x, x, w, x, r, 8, 96, 96, 96, 96, 1e-6, 0.0),\n"
        "                  dict(HAS_GATE=False, BLOCK_M=8, BLOCK_N=128, num_warps=4))\n"
        "print(type(k).__name__, json.dumps(launch.to_json(), sort_keys=True))\n")
    outs = []
    for interpret in ("1", None):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        if interpret:
            env["TRITON_INTERPRET"] = interpret
        env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
        proc = subprocess.run([sys.executable, "-c", snippet], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs.append(proc.stdout.strip().split(" ", 1))
    assert [o[0] for o in outs] == ["InterpretedFunction", "JITFunction"]
    assert outs[0][1] == outs[1][1]
