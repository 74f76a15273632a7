"""benchmarks/gpu_check.sh, the one-call script for a lent GPU, is run here as a CPU dry run
(GPU_CHECK_SMOKE=1): no build, the GPU test files only collected, every benchmark script at
tiny shapes in the Triton interpreter. A GPU lease is short, so the script's plumbing (steps,
arguments, outputs, summary, archive) is checked before one happens. Nothing is measured.
"""
import json
import os
import sys
import tarfile

import pytest

from conftest import ROOT, run_in_own_group


@pytest.mark.slow
def test_gpu_check_dry_run_on_cpu(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, GPU_CHECK_SMOKE="1", PYTHON=sys.executable, OUT=str(out), CUDA_VISIBLE_DEVICES="",
               TORCHDYNAMO_DISABLE="1")
    rc, log = run_in_own_group(["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh")], env=env, timeout=600,
                               what="the gpu_check.sh dry run")
    assert rc == 0, log[-6000:]

    summary = (out / "summary.txt").read_text().splitlines()
    steps = {line.split()[0]: line for line in summary}
    for name in ("tests/kernels/test_rowwise.py", "tests/kernels/test_gdn_triton.py", "tests/kernels/test_gdn.py",
                 "tests/kernels/test_causal_conv1d.py", "tests/kernels/test_moe.py", "tests/kernels/test_packed_attention.py",
                 "benchmarks.scripts.rowwise_gpu", "benchmarks.scripts.gdn_gpu", "benchmarks.scripts.moe_gpu",
                 "benchmarks.scripts.attention_gpu", "benchmarks.scripts.train_step", "benchmarks"):
        assert name in steps and " ok " in steps[name], summary
    assert "SKIPPED (dry run)" in steps["build"]
    # the harness runs twice (fused linear CE, then the row-wise / MoE ops): both ok, one log each
    harness = [line for line in summary if line.split()[0] == "benchmarks"]
    assert len(harness) == 2 and all(" ok " in line for line in harness), summary
    megatron = next(line for line in summary if line.startswith("megatron"))
    assert " ok " in megatron or "no megatron-core" in megatron, summary

    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        names = {os.path.normpath(n) for n in tar.getnames()}
        read = lambda n: json.load(tar.extractfile("./" + n))  # noqa: E731
        rowwise, gdn, moe, attn, bench = (read(n) for n in ("rowwise_gpu.json", "gdn_gpu.json", "moe_gpu.json",
                                                               "attention_gpu.json", "bench/results.json"))
        step = read("train_step.json")
    assert {"rowwise_gpu.md", "gdn_gpu.md", "moe_gpu.md", "attention_gpu.md", "bench/summary.md",
            "train_step.md", "summary.txt"} <= names
    # the training-step benchmark ran each variant, its loss guard passed, each row has a time
    assert [r["variant"] for r in step["rows"]] == ["hf_eager", "hf_autocast", "hf_patched", "facade_twinkle"]
    assert all(r["status"] == "ok" and r["step_s"] > 0 for r in step["rows"]), step["rows"]
    # with the GEMM floor of each transformers row
    assert all((r["variant"] == "facade_twinkle") != (r.get("gemm_floor", {}).get("seconds", 0) > 0)
               for r in step["rows"]), step["rows"]
    # the collected test files report tests, not an empty or broken collection
    assert all(f"pytest_{n}.log" in names for n in ("test_rowwise", "test_gdn", "test_moe"))
    assert {"bench_benchmarks.log", "bench_benchmarks_2.log"} <= names

    # each script really ran its op: rows with times, and its own correctness check passed
    assert {r["op"] for r in rowwise["rows"]} >= {"copy", "rms_norm", "swiglu", "apply_rotary_pos_emb"}
    assert all(e.get("finite", True) and "failed" not in e for e in rowwise["max_errors"])
    twinkle = next(r for r in gdn["rows"] if r["provider"] == "twinkle-triton")
    hf = next(r for r in gdn["rows"] if r["provider"] == "transformers-torch")
    assert twinkle["status"] == "ok" and twinkle["fwd"]["median_ms"] > 0
    assert hf["status"] == "ok" and hf["rel_max_diff_vs_twinkle"] < 1e-4
    # the packed batch: twinkle's varlen path ran; transformers' torch path has no cu_seqlens
    packed = [r for r in gdn["rows"] if "varlen" in r["shape"]]
    assert next(r for r in packed if r["provider"] == "twinkle-triton")["status"] == "ok"
    assert next(r for r in packed if r["provider"] == "transformers-torch")["status"] == "unsupported"
    # peers that are not installed here are reported as missing, with the reason
    assert all(r.get("reason") for r in gdn["rows"] if r["status"] == "missing")
    assert "liger" in rowwise["meta"]["peers"] or any(r["impl"] == "liger" for r in rowwise["rows"])
    hf_moe = next(r for r in moe["rows"] if r["impl"] == "transformers grouped_mm experts")
    assert (hf_moe["status"] == "ok" and hf_moe["rel_max_diff_vs_triton"] < 1e-4) or hf_moe.get("reason"), hf_moe
    # packed attention on the CPU: the per-sample loop runs, the varlen kernel is CUDA-only
    loop = next(r for r in attn["rows"] if r["impl"] == "sdpa_loop")
    assert loop["status"] == "ok" and loop["fwd"]["median_ms"] > 0
    assert "CUDA-only" in next(r for r in attn["rows"] if r["impl"] == "varlen")["reason"]
    triton_mm = next(r for r in moe["rows"] if r["impl"] == "triton")
    assert triton_mm["status"] == "ok" and triton_mm["max_err_vs_float64"] < 1e-4
    assert any(r["impl"] == "moe_experts triton" and r["fwd_bwd_ms"] > 0 for r in moe["rows"])
    assert {r["provider"] for r in bench["rows"] if r.get("status") == "ok"} >= {"eager", "twinkle-cpu"}
