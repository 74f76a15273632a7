"""Published architectures (tests/published_configs.py, cut in depth) on real megatron-core, 2 ranks, gloo.

For every entry of ``published_configs.CI_ENTRIES`` (the table's own checks cover every entry),
transformers builds the model with random weights (fp32) and saves it; this process
computes transformers' fp32 and float64 logits, loss and grad norm on one batch (2 x 16 tokens);
then one 2-rank launch runs every (entry, layout, layer spec) in turn
(tests/megatron_workers/widths_worker.py) and each check below reads its run:

- HF -> megatron -> HF round trip bit-identical (TP2, or EP2 for the MoE models; also PP2 for the
  tied-embedding Qwen3-0.6B);
- TP2 (EP2 for MoE): the local layer spec's logits within 1e-5 relative (max |diff| / max |ref|)
  of transformers' fp32; with ``use_twinkle_kernels=True``, at least as close to the float64 run
  as transformers' fp32 is; PP2 (entries cut to two layers), the same for the twinkle_kernels spec.
  With pipeline size 2 ``logits()`` is unavailable, so the probe is ``forward_only``'s per-token
  log-probs of the labels, judged the same way;
- the first training step's loss within 1e-5 relative of transformers', and its pre-clip grad norm
  within 1e-4 relative (Llama-3.1-8B's is not: an expected failure, see below).
"""
import gc
import math
import os

import pytest
import torch

pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5MoeTextConfig"):
    pytest.skip("transformers has no Qwen3.5 models", allow_module_level=True)

from tests import published_configs as pc  # noqa: E402
from tests.megatron_workers.protocol import ROOT, launch  # noqa: E402

BATCH, SEQ = 2, 16
LOCAL_TOL, LOSS_TOL, NORM_TOL = 1e-5, 1e-5, 1e-4
WORKER = os.path.join(ROOT, "tests", "megatron_workers", "widths_worker.py")


def layouts(name):
    """``(layout name, mesh, probe)`` for an entry: TP2 or EP2 first (logits), then PP2 (log-probs)."""
    first = ("ep2", {"ep_size": 2}, "logits") if pc.is_moe(name) else ("tp2", {"tp_size": 2}, "logits")
    out = [first]
    if pc.CUTS[name]["layers"] % 2 == 0:
        out.append(("pp2", {"pp_size": 2}, "logps"))
    return out


def runs_of(name):
    """``(run name, layout name, twinkle, mesh, probe)`` of every run of ``name``: both layer specs
    under the first layout, the twinkle_kernels spec under PP2 (the local spec under PP2 equals
    its TP1/PP1 self in tests/test_megatron.py)."""
    out = []
    for i, (lay, mesh, probe) in enumerate(layouts(name)):
        for tw in ((False, True) if i == 0 else (True,)):
            out.append((f"{name}-{lay}-{'twinkle' if tw else 'local'}", lay, tw, mesh, probe))
    return out


CASES = [(n, lay, tw) for n in pc.CI_ENTRIES for _, lay, tw, _, _ in runs_of(n)]
EXPORTS = [(n, "ep2" if pc.is_moe(n) else "tp2") for n in pc.CI_ENTRIES] + \
    ([("qwen3_0_6b", "pp2")] if "qwen3_0_6b" in pc.CI_ENTRIES else [])


def _rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def _logps(logits, labels):
    """Per-token log p(labels[t] | tokens before t), [B, S], 0 where there is no prediction."""
    out = torch.zeros(labels.shape, dtype=logits.dtype)
    lp = torch.log_softmax(logits[:, :-1], -1)
    target = labels[:, 1:]
    got = lp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    out[:, 1:] = torch.where(target == -100, torch.zeros_like(got), got)
    return out


def _randomize(model):
    """transformers' init, then every 1-D parameter (norms, A_log, dt_bias) perturbed, so a
    per-channel mix-up cannot hide behind equal values."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g))


def _reference(name, root):
    """Save the entry's random-weight checkpoint and transformers' results on its batch."""
    cfg = transformers.AutoConfig.for_model(**pc.cut(name))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _randomize(model)
    path = os.path.join(root, name)
    model.save_pretrained(path)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    batch = {"input_ids": ids, "labels": labels}
    torch.save(batch, os.path.join(root, name + "-batch.pt"))
    out = model(**batch)
    out.loss.backward()
    ref = {"loss": float(out.loss.detach()),
           "grad_norm": math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters())),
           "logits32": out.logits.detach()}
    del out
    model.zero_grad(set_to_none=True)
    if pc.is_moe(name):   # torch._grouped_mm has no float64
        model.set_experts_implementation("eager")
    model.double()
    with torch.no_grad():
        ref["logits64"] = model(input_ids=ids).logits
    del model
    gc.collect()
    ref["logps32"], ref["logps64"] = _logps(ref["logits32"], labels), _logps(ref["logits64"], labels)
    return path, ref


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """{entry: (checkpoint dir, transformers' results)} and the per-run worker outputs."""
    root = str(tmp_path_factory.mktemp("published"))
    refs, dirs = {}, {}
    for name in pc.CI_ENTRIES:
        dirs[name], refs[name] = _reference(name, root)
    exports = {(n, lay): os.path.join(root, f"x-{n}-{lay}") for n, lay in EXPORTS}
    runs = []
    for name in pc.CI_ENTRIES:
        seen = set()
        for run, lay, tw, mesh, probe in runs_of(name):   # export from the first run of each layout
            runs.append({"name": run, "model_dir": dirs[name], "mesh": mesh, "twinkle": tw, "probe": probe,
                         "export": None if lay in seen else exports.get((name, lay))})
            seen.add(lay)
    spec = {"runs": runs, "batches": {dirs[n]: os.path.join(root, n + "-batch.pt") for n in dirs}}
    workdir = os.path.join(root, "ranks")
    results, rcs, logs, elapsed = launch(2, spec, workdir, timeout=900, script=WORKER)
    assert all(r is not None for r in results), "a rank wrote no result:\n" + "\n".join(l[-3000:] for l in logs)
    assert rcs == [0, 0], (rcs, "\n".join(l[-3000:] for l in logs))
    print(f"[published widths: {len(runs)} runs on 2 ranks in {elapsed:.0f}s]")
    outs = {}
    for run in runs:
        for rank, res in enumerate(results):
            assert res[run["name"]]["ok"], f"rank {rank}, {run['name']}: {res[run['name']].get('traceback')}"
        outs[run["name"]] = torch.load(os.path.join(workdir, run["name"] + ".pt"))
    return {"dirs": dirs, "refs": refs, "outs": outs, "exports": exports}


def _probe(published, name, lay, twinkle):
    out = published["outs"][f"{name}-{lay}-{'twinkle' if twinkle else 'local'}"]
    ref = published["refs"][name]
    key = "logits" if "logits" in out else "logps"
    return out[key], ref[key + "32"], ref[key + "64"]


# ---- the table ------------------------------------------------------------------------------

def test_qwen3_5_entries_are_transformers_defaults():
    for name, config_cls in (("qwen3_5_text", transformers.Qwen3_5TextConfig),
                             ("qwen3_5_moe_text", transformers.Qwen3_5MoeTextConfig)):
        defaults = config_cls().to_dict()
        entry = pc.PUBLISHED[name]
        for key, value in entry.items():
            if key == "full_attention_interval":
                types = defaults["layer_types"]
                assert [i for i, t in enumerate(types) if t == "full_attention"] == \
                    list(range(value - 1, len(types), value)), name
                continue
            assert defaults[key] == value, (name, key, defaults[key], value)


def test_cuts_keep_the_widths():
    from twinkle_megatron import config
    for name in pc.PUBLISHED:
        full = config.model_shape(transformers.AutoConfig.for_model(**pc.PUBLISHED[name]).to_dict())
        small = config.model_shape(transformers.AutoConfig.for_model(**pc.cut(name)).to_dict())
        assert small.num_layers == pc.CUTS[name]["layers"] <= 2
        if small.hybrid:
            assert set(small.layer_types) == {"linear_attention", "full_attention"}
        for field in ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim", "rope_theta",
                      "rope_scaling_factor", "tie_word_embeddings", "moe_intermediate_size", "moe_topk",
                      "shared_expert_intermediate_size", "linear_num_value_heads", "partial_rotary_factor"):
            assert getattr(small, field) == getattr(full, field), (name, field)
        for field in ("vocab_size", "num_experts"):
            assert getattr(small, field) == pc.CUTS[name].get(field, getattr(full, field)), (name, field)
    assert pc.cut("qwen3_30b_a3b")["num_experts"] == 128


def test_llama3_rope_scaling_is_read_and_unknown_variants_refused():
    from twinkle_megatron import config
    shape = config.model_shape(transformers.AutoConfig.for_model(**pc.cut("llama3_1_8b")).to_dict())
    assert shape.rope_scaling_factor == 8.0 and shape.rope_theta == 500000.0
    bad = dict(pc.cut("llama3_1_8b"), rope_scaling=dict(pc.PUBLISHED["llama3_1_8b"]["rope_scaling"],
                                                       high_freq_factor=2.0))
    with pytest.raises(ValueError, match="high_freq_factor"):
        config.model_shape(bad)
    with pytest.raises(ValueError, match="rope_type='yarn'"):
        config.model_shape(dict(bad, rope_scaling={"rope_type": "yarn", "factor": 4.0}))


# ---- on megatron ----------------------------------------------------------------------------

@pytest.mark.multiprocess
@pytest.mark.parametrize("name, lay", EXPORTS)
def test_round_trip_is_bit_identical(published, name, lay):
    from safetensors.torch import load_file

    def weights(path):
        out = {}
        for f in sorted(os.listdir(path)):
            if f.endswith(".safetensors"):
                out.update(load_file(os.path.join(path, f)))
        return out
    original, saved = weights(published["dirs"][name]), weights(published["exports"][(name, lay)])
    assert set(saved) == set(original)
    for k in original:
        assert torch.equal(saved[k], original[k]), k


@pytest.mark.multiprocess
@pytest.mark.parametrize("name, lay, twinkle", CASES)
def test_logits_against_float64_transformers(published, name, lay, twinkle):
    mine, ref32, ref64 = _probe(published, name, lay, twinkle)
    hf_error = _rel(ref32, ref64)
    print(f"{name} {lay} {'twinkle' if twinkle else 'local'}: vs fp32 {_rel(mine, ref32):.2e}, "
          f"vs fp64 {_rel(mine, ref64):.2e}, transformers fp32 vs fp64 {hf_error:.2e}")
    if twinkle:
        assert _rel(mine, ref64) <= hf_error
    else:
        assert _rel(mine, ref32) <= LOCAL_TOL


@pytest.mark.multiprocess
@pytest.mark.parametrize("name, lay, twinkle", CASES)
def test_training_step_loss_matches_transformers(published, name, lay, twinkle):
    out = published["outs"][f"{name}-{lay}-{'twinkle' if twinkle else 'local'}"]
    ref = published["refs"][name]
    assert abs(out["loss"] - ref["loss"]) <= LOSS_TOL * abs(ref["loss"]), (out["loss"], ref["loss"])


# Llama-3.1-8B's widths: the loss and logits agree (1e-6), the pre-clip grad norm does not
# (50.367 against transformers' 50.416, 9.7e-4 relative): a gradient differs somewhere, not found yet.
_NORM_XFAIL = {"llama3_1_8b": "grad norm 9.7e-4 relative off transformers' (open)"}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name, lay, twinkle", [
    pytest.param(n, lay, tw, marks=pytest.mark.xfail(strict=True, reason=_NORM_XFAIL[n])) if n in _NORM_XFAIL
    else (n, lay, tw) for n, lay, tw in CASES])
def test_training_step_grad_norm_matches_transformers(published, name, lay, twinkle):
    out = published["outs"][f"{name}-{lay}-{'twinkle' if twinkle else 'local'}"]
    ref = published["refs"][name]
    assert abs(out["grad_norm"] - ref["grad_norm"]) <= NORM_TOL * ref["grad_norm"], (out["grad_norm"], ref["grad_norm"])


def test_benchmark_writes_out_the_same_qwen3_0_6b():
    """The full-depth benchmark (which may not import tests/) carries its own copy of the entry."""
    from benchmarks.scripts.published_widths_cpu import QWEN3_0_6B
    assert QWEN3_0_6B == pc.PUBLISHED["qwen3_0_6b"]
