"""benchmarks/scripts/train_step.py, the step benchmark of issue 48, at tiny widths: its plumbing,
never its timings. Every variant (transformers eager, autocast, + twinkle_patches; the facade with
the local spec and with twinkle kernels; each full and with LoRA r=8) runs one warm-up and one timed
step; the rows, the phase table and the loss guard are checked, the guard against a deliberately
wrong model (``hf_perturbed``, its LM head times 10) that it must refuse to time.
"""
import json
import os
import sys

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("peft")

from conftest import ROOT, run_in_own_group  # noqa: E402
from tests import published_configs as pc  # noqa: E402
from benchmarks.scripts import train_step as ts  # noqa: E402

pytestmark = pytest.mark.timeout(900)
FACADE_PHASES = {"forward", "backward", "lm_head_loss", "main_grad", "grad_finalise", "norm_clip", "optimizer",
                 "zero_grad", "other"}
HF_PHASES = {"forward", "backward", "lm_head_loss", "norm_clip", "optimizer", "zero_grad"}


def test_models_are_the_published_configs():
    """The benchmark's written-out configs are tests/published_configs.py's entries, and its depth
    cut keeps the widths and the hybrid's 3:1 pattern (at least one GDN and one attention layer)."""
    assert ts.QWEN3_0_6B == pc.PUBLISHED["qwen3_0_6b"]
    assert ts.QWEN3_30B_A3B == pc.PUBLISHED["qwen3_30b_a3b"]
    assert ts.QWEN3_5_TEXT == pc.PUBLISHED["qwen3_5_text"]
    assert ts.model_config("qwen3_0_6b")["num_hidden_layers"] == 28
    moe = ts.model_config("qwen3_30b_a3b")
    assert moe["num_hidden_layers"] == 2 and moe["num_experts"] == 128 and moe["hidden_size"] == 2048
    assert ts.model_config("qwen3_30b_a3b", 100)["num_hidden_layers"] == 48
    lin, full = "linear_attention", "full_attention"
    assert ts.model_config("qwen3_5_dense")["layer_types"] == [lin, lin, lin, full]
    assert ts.model_config("qwen3_5_dense", 2)["layer_types"] == [lin, full]
    assert ts.model_config("qwen3_5_dense", 1)["layer_types"] == [lin, full]
    assert ts.model_config("qwen3_5_dense", 8)["layer_types"] == [lin, lin, lin, full] * 2
    assert ts.model_config("qwen3_5_dense", 4)["hidden_size"] == 4096
    assert ts.model_config("qwen3_30b_a3b", 1, vocab=32768)["vocab_size"] == 32768
    assert ts.model_config("qwen3_30b_a3b", 1, vocab=32768)["hidden_size"] == 2048
    assert ts.model_config("qwen3_0_6b", vocab=10 ** 6)["vocab_size"] == 151936   # never widened
    with pytest.raises(ValueError, match="--vocab"):
        ts.model_config("qwen3_0_6b", vocab=1)
    with pytest.raises(ValueError, match="unknown model 'qwen9'"):
        ts.model_config("qwen9")
    with pytest.raises(ValueError, match="--layers"):
        ts.model_config("qwen3_0_6b", 0)


@pytest.mark.parametrize("argv, match", [
    (["--variants", "hf_eager,hf_fast"], "unknown variant 'hf_fast'"),
    (["--dtypes", "fp16"], "unknown dtype 'fp16'"),
    (["--models", "qwen9"], "unknown model 'qwen9'"),
    (["--steps", "0"], "--steps"),
])
def test_bad_arguments_are_refused(argv, match):
    with pytest.raises(ValueError, match=match):
        ts.main(["--tiny"] + argv)


def _run(tmp_path, args, timeout=600):
    out = tmp_path / "train_step.md"
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", PYTHONPATH=ROOT)
    rc, log = run_in_own_group([sys.executable, "-m", "benchmarks.scripts.train_step", "--tiny", "--seq", "16",
                                "--steps", "1", "--out", str(out)] + args, env=env, timeout=timeout,
                               what="the train_step benchmark")
    assert rc == 0, log[-4000:]
    data = json.loads((tmp_path / "train_step.json").read_text())
    return data, out.read_text()


def _table(text, header_start):
    """The rows (lists of cells) of the markdown table whose header starts with ``header_start``."""
    lines = text.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[i + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return [c.strip() for c in lines[i].strip("|").split("|")], rows


@pytest.mark.slow
def test_every_variant_runs_and_the_guard_refuses_a_wrong_model(tmp_path):
    variants = list(ts.VARIANTS) + ["hf_perturbed"]
    data, text = _run(tmp_path, ["--models", "qwen3_0_6b,qwen3_30b_a3b,qwen3_5_dense", "--layers", "1",
                                 "--dtypes", "bf16", "--variants", ",".join(variants), "--lora", "--in-process"])
    rows = data["rows"]
    models = ("qwen3_0_6b", "qwen3_30b_a3b", "qwen3_5_dense")
    assert [(r["model"], r["variant"], r["lora"]) for r in rows] == \
        [(m, v, lora) for m in models for lora in (False, True) for v in variants]
    by = {(r["model"], r["variant"], r["lora"]): r for r in rows}
    for r in rows:
        if r["variant"] == "hf_perturbed":
            # the deliberately wrong model: refused, not timed
            assert r["status"] == "wrong" and "not timed" in r["reason"] and "step_s" not in r, r
            continue
        assert r["status"] == "ok", r
        assert r["step_s"] > 0 and r["trainable"] > 0
        ref = by[(r["model"], "hf_eager", False)]["first_loss"]
        assert abs(r["first_loss"] - ref) <= 2e-2 * abs(ref)
        facade = r["variant"].startswith("facade")
        assert set(r["phases"]) == (FACADE_PHASES if facade else HF_PHASES), r["phases"]
        assert all(v >= 0 for v in r["phases"].values()), r["phases"]
        assert r["phases"]["forward"] > 0 and r["phases"]["lm_head_loss"] > 0
        if facade:
            # megatron DDP's per-parameter hooks were probed: one call per trainable parameter tensor
            assert r["counts"]["main_grad_hooks"] > 0, r
        if r["lora"]:
            assert r["trainable"] < by[(r["model"], r["variant"], False)]["trainable"]
    # LoRA r=8 on all linear layers trains as many parameters through peft as through the facade
    for m in ("qwen3_0_6b", "qwen3_5_dense"):
        assert by[(m, "hf_eager", True)]["trainable"] == by[(m, "facade_twinkle", True)]["trainable"], m
    assert any("experts_implementation=grouped_mm" in n for n in by[("qwen3_30b_a3b", "hf_eager", False)]["notes"])

    header, table = _table(text, "| model | dtype | variant |")
    assert header[6] == "CPU s / step" and header[7] == "vs transformers eager"
    assert len(table) == len(rows)
    for cells, r in zip(table, rows):
        assert cells[2] == ts.LABELS[r["variant"]]
        if r["status"] == "ok":
            assert float(cells[6]) == pytest.approx(r["step_s"], abs=1e-3)
            assert cells[7].endswith("x") and cells[8].endswith("x")
            if r["variant"] == "hf_eager":
                assert cells[7] == "1.00x"
            assert cells[9].endswith("x") if r["lora"] else cells[9] == "—"
        else:
            assert cells[6] == "—" and cells[7] == "—" and "**wrong**" in cells[11]
    header, phases = _table(text, "| model | dtype | variant | LoRA | forward |")
    assert header[-1] == "sum" and len(header) == 4 + len(ts.PHASES) + 1
    assert len(phases) == sum(r["status"] == "ok" for r in rows)


@pytest.mark.slow
def test_each_variant_in_its_own_process_reports_its_peak_rss(tmp_path):
    data, text = _run(tmp_path, ["--models", "qwen3_30b_a3b", "--layers", "1", "--dtypes", "fp32",
                                 "--variants", "hf_eager,facade_twinkle"])
    rows = data["rows"]
    assert [r["variant"] for r in rows] == ["hf_eager", "facade_twinkle"]
    for r in rows:
        assert r["status"] == "ok" and r["peak_mb"] > 100, r
    header, table = _table(text, "| model | dtype | variant |")
    assert header[10] == "peak RSS (GB)" and all(float(cells[10]) > 0.1 for cells in table)
    # the kernel's share of each step: system time within the step's CPU time, faults counted
    header, system = _table(text, "| model | dtype | variant | LoRA | CPU s / step | of which system |")
    assert [c[2] for c in system] == [ts.LABELS[r["variant"]] for r in rows]
    for cells, r in zip(system, rows):
        assert 0 <= r["system_s"] <= r["step_s"] and r["minor_faults"] >= 0, r
        assert float(cells[4]) == pytest.approx(r["step_s"], abs=1e-3)
        assert float(cells[5]) == pytest.approx(r["system_s"], abs=1e-3)
        assert int(cells[6].replace(",", "")) == r["minor_faults"]
    assert "`THP_MEM_ALLOC_ENABLE` (2 MiB pages for large tensors): " in text


@pytest.mark.slow
def test_published_widths_script_runs_the_step_benchmark(tmp_path):
    """benchmarks/scripts/published_widths_cpu.py (the conversion check, then this benchmark's
    table for Qwen3-0.6B) still runs, at tiny widths."""
    out = tmp_path / "published.md"
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", PYTHONPATH=ROOT)
    rc, log = run_in_own_group([sys.executable, "-m", "benchmarks.scripts.published_widths_cpu", "--tiny", "--steps",
                                "1", "--seq", "16", "--out", str(out)], env=env, timeout=600,
                               what="published_widths_cpu --tiny")
    assert rc == 0, log[-4000:]
    text = out.read_text()
    assert "- HF -> megatron -> HF: bit-identical" in text
    assert "## Training step (benchmarks/scripts/train_step.py)" in text
    _, table = _table(text, "| model | dtype | variant |")
    assert [(c[1], c[2]) for c in table] == [("fp32", ts.LABELS[v]) for v in ts.VARIANTS if v != "hf_autocast"] + \
        [("bf16", ts.LABELS[v]) for v in ts.VARIANTS]
    assert all(float(c[6]) > 0 for c in table), table


@pytest.mark.slow
def test_gemm_floor_bounds_each_transformers_row(tmp_path):
    """``--gemm-floor``: each transformers row gets its step's products replayed (none for the
    facade's), and the section's ceiling is that row's step over the replayed time."""
    data, text = _run(tmp_path, ["--models", "qwen3_0_6b", "--layers", "1", "--dtypes", "bf16",
                                 "--variants", "hf_autocast,facade_twinkle", "--gemm-floor", "--in-process"])
    hf, facade = data["rows"]
    assert hf["status"] == facade["status"] == "ok"
    assert "gemm_floor" not in facade
    g = hf["gemm_floor"]
    # one tiny Qwen3 layer: q, k, v, o, gate, up, down and the LM head, each forward and twice backward
    assert g["calls"] >= 3 * 8 and g["flops"] > 0 and g["seconds"] > 0
    assert {r[2] for r in g["rows"]} == {"bfloat16"}, g["rows"]   # autocast's dtype, not the fp32 params'
    header, table = _table(text, "| model | dtype | variant | LoRA | products (distinct) |")
    (cells,) = table
    assert cells[2] == ts.LABELS["hf_autocast"]
    assert float(cells[6]) == pytest.approx(g["seconds"], abs=1e-3)
    ceiling = hf["step_s"] / g["seconds"]
    assert cells[10] == f"{ceiling:.2f}x" and float(cells[11]) == pytest.approx(facade["step_s"], abs=1e-3)
    assert cells[12] == f"{hf['step_s'] / facade['step_s']:.2f}x"
