"""Context parallelism through the facade's Gated DeltaNet layers (issue 37, the facade half), plain and packed rows.

Under CP2 on 2 gloo ranks, megatron's load-balanced split gives rank r chunks r and 3 - r of each
row's 4 chunks; the GDN layers run on twinkle_kernels' CP ops (state passing, conv halos). Three
training steps equal the single-process run (in this process), fp32: losses, pre-clip grad norms,
the trained parameters as one vector and forward_only's full ``[B, S]`` log-probs on every rank
afterwards within 1e-6 relative, each parameter tensor within 1e-6
(``||a - b|| / ||b||``; a LoRA adapter's tensors within 1e-5, see the test), a LoRA run's frozen
base bit for bit, for:

- Qwen3.5 dense (2 GDN + 2 gated-attention layers, grouped value heads), with megatron's local
  modules and with ``use_twinkle_kernels=True``, each with and without a LoRA adapter;
- Qwen3.5 MoE (experts + gated shared expert), twinkle;
- Qwen3-Next (GDN + gated attention, MoE with a shared expert, aux loss), local and twinkle;
- Qwen3.5 dense, twinkle, with full activation recompute (the GDN layers rerun in the backward).

On 4 ranks, CP2 x TP2 with sequence parallelism (Qwen3.5 local and twinkle, Qwen3-Next twinkle
with expert-TP 1 and 2) and CP2 x PP2 (Qwen3.5 twinkle), and on 2 ranks CP2 x EP2 (Qwen3.5 MoE
twinkle): losses and grad norms within 1e-6 of the single-process run.

Packed rows (``position_ids`` restarting, :data:`PACKING`): each micro-batch is one THD row split
over the CP ranks as a plain row is (chunks r and 2cp - 1 - r of the whole row), samples crossing
chunk boundaries, lying inside one, of one token. The same bars against the single-process packed
run, for Qwen3.5 dense local / twinkle / twinkle + LoRA, Qwen3.5 MoE, Qwen3-Next local / twinkle on
CP2, Qwen3.5 twinkle with full recompute, Qwen3.5 local with selective recompute of the core
attention, CP2 x EP2 (MoE), and on 4 ranks CP2 x TP2 + SP (Qwen3.5 local / twinkle, Qwen3-Next
twinkle) and CP2 x PP2 (Qwen3.5 local / twinkle); also a plain-attention Qwen3 (local / twinkle) on
CP2. The CP attention alone on packed rows (output and gradients, with and without a sliding
window) is checked against per-sample float64 attention, and the packed runs' forward_only
``return_topk`` outputs against the single-process run's.

A run whose layer is handed contiguous shards instead of the zigzag segments, and a packed run
whose model sees one sample boundary one token late, must differ from the single-process one (the
test can fail); cu_seqlens divided by cp are refused. The models' decay is slow (A_log small) so
that the state passed between ranks matters.
"""
import os

import pytest
from conftest import ROOT, megatron_one_rank
import torch

pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5ForCausalLM") or not hasattr(transformers, "Qwen3NextForCausalLM"):
    pytest.skip(f"transformers {transformers.__version__} has no Qwen3.5 / Qwen3-Next models",
                allow_module_level=True)

from tests.megatron_workers.protocol import launch  # noqa: E402

WORKER = os.path.join(ROOT, "tests", "megatron_workers", "gdn_cp_worker.py")
# 4 rows of 32 tokens, 2 per micro-batch: each CP rank holds two 8-token chunks of every row, the
# conv's 3-token halo and the delta rule's state crossing every chunk boundary
# Adam's eps at 1e-4: an entry whose gradient is below it moves in proportion to it, not by a
# full step of lr whatever its rounding noise says
SPEC = {"batch": 4, "seq": 32, "mbs": 2, "steps": 3, "vocab": 64, "adam_eps": 1e-4}
INIT_STD = 0.06
LORA = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "init_lora_weights": True}
RTOL = 1e-6
# Packed rows: per row of 30 tokens, its samples' lengths (position_ids restart at each). With 2
# rows per micro-batch the THD row has 60 tokens, padded to 64 (2 * cp, x tp with SP): chunks
# [0, 16) [16, 32) [32, 48) [48, 64), rank 0 holding the first and last. Micro-batch 1: [6, 18)
# crosses the 16 boundary, [0, 5) lies inside a chunk, [5, 6) has one token, [30, 33) crosses 32,
# [47, 60) crosses 48; micro-batch 2: a boundary on a chunk boundary (16), a one-token sample
# right after it, and one 30-token sample across two chunk boundaries (32 and 48).
PACKING = [[5, 1, 12, 12], [3, 14, 13], [16, 1, 13], [30]]
RUNS = {   # name -> (model, twinkle, lora[, packing])
    "qwen35_local": ("qwen3_5", False, None),
    "qwen35_twinkle": ("qwen3_5", True, None),
    "qwen35_twinkle_lora": ("qwen3_5", True, LORA),
    "qwen35_local_lora": ("qwen3_5", False, LORA),
    "qwen35_moe_twinkle": ("qwen3_5_moe", True, None),
    "qwen35_moe_local": ("qwen3_5_moe", False, None),
    "next_local": ("qwen3_next", False, None),
    "next_twinkle": ("qwen3_next", True, None),
    "qwen35_local_packed": ("qwen3_5", False, None, PACKING),
    "qwen35_twinkle_packed": ("qwen3_5", True, None, PACKING),
    "qwen35_twinkle_lora_packed": ("qwen3_5", True, LORA, PACKING),
    "qwen35_moe_twinkle_packed": ("qwen3_5_moe", True, None, PACKING),
    "qwen35_moe_local_packed": ("qwen3_5_moe", False, None, PACKING),
    "next_local_packed": ("qwen3_next", False, None, PACKING),
    "next_twinkle_packed": ("qwen3_next", True, None, PACKING),
    "qwen3_local_packed": ("qwen3", False, None, PACKING),
    "qwen3_twinkle_packed": ("qwen3", True, None, PACKING),
}


def _hf(model: str, seed: int = 0):
    """The tiny transformers model: Qwen3.5 dense as tests/megatron/test_megatron_hybrid's, Qwen3-Next as
    tests/megatron/test_families', with weights drawn at std 0.06 (transformers' 0.02 leaves the logits
    near uniform: contiguous shards moved the loss by 2e-5 only)."""
    from tests.megatron.test_families import FAMILIES
    from tests.megatron.test_megatron_hybrid import HYBRID, HYBRID_MOE
    if model == "qwen3":   # plain attention only: packed CP through the CP attention alone
        cfg_cls, cls = transformers.Qwen3Config, transformers.Qwen3ForCausalLM
        fields = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, vocab_size=64, head_dim=8,
                      max_position_embeddings=128, intermediate_size=48, num_hidden_layers=2,
                      tie_word_embeddings=False)
    elif model == "qwen3_5":
        cfg_cls, cls = transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM
        fields = {k: v for k, v in HYBRID.items() if k != "model_type"}
    elif model == "qwen3_5_moe":
        cfg_cls, cls = transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM
        fields = {k: v for k, v in HYBRID_MOE.items() if k != "model_type"}
    else:
        cfg_cls, cls, fields, _ = FAMILIES["qwen3_next"]
        cfg_cls, cls = getattr(transformers, cfg_cls), getattr(transformers, cls)
    torch.manual_seed(seed)
    hf = cls(cfg_cls(**fields, initializer_range=INIT_STD)).float()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n or n.endswith("dt_bias") or n.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.3)   # norms, dt_bias and routers off their defaults
            elif n.endswith("A_log"):
                # slow decay (A in [0.01, 0.2]: 0.3 to 0.95 of the state left after an 8-token
                # chunk), so the state passed between CP ranks matters; transformers' A up to 16
                # leaves ~0.004 of it per token, and gradients of the decay that are rounding noise
                p.copy_(torch.empty_like(p).uniform_(0.01, 0.2).log())
    return hf


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gdn_cp")
    out = {"root": root}
    for model in ("qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen3"):
        _hf(model).save_pretrained(str(root / model))
        out[model] = str(root / model)
    return out


# name -> (the single-process run it must equal, mesh, MegatronModel keywords): full recompute and
# CP2 x EP2 (the Qwen3.5 MoE experts split over the CP ranks) on 2 ranks; CP2 x TP2 + SP and
# CP2 x PP2 on 4 ranks. Weights are compared where every rank holds them all (CP alone).
FULL_RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
# the core attention alone rerun in the backward: the per-token rotary reaches the rerun too
SELECTIVE = {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
# expert-TP 1 (the default): the MoE models' TP ranks hold whole experts, each running its own
# sequence share, so expert grads are summed over TP too (megatron's expert-data-parallel group);
# expert-TP 2 splits them like the dense MLPs. Before ddp.mark_expert_params, Qwen3-Next under
# expert-TP 1 was off by 6.2e-4 in the grad norm and 6.5e-3 in the log-probs.
TP2SP = {"cp_size": 2, "tp_size": 2, "sequence_parallel": True, "etp_size": 1}
TP2SP_ETP2 = dict(TP2SP, etp_size=2)
LAYOUTS = {
    "qwen35_twinkle_recompute": ("qwen35_twinkle", {"cp_size": 2}, FULL_RECOMPUTE),
    "moe_cp2_ep2_twinkle": ("qwen35_moe_twinkle", {"cp_size": 2, "ep_size": 2}, {}),
    "cp2_tp2sp_local": ("qwen35_local", TP2SP, {}),
    "cp2_tp2sp_twinkle": ("qwen35_twinkle", TP2SP, {}),
    "cp2_pp2_twinkle": ("qwen35_twinkle", {"cp_size": 2, "pp_size": 2}, {}),
    "next_cp2_tp2sp_twinkle": ("next_twinkle", TP2SP, {}),
    "next_cp2_tp2sp_etp2_twinkle": ("next_twinkle", TP2SP_ETP2, {}),
    # packed rows
    "qwen35_twinkle_recompute_packed": ("qwen35_twinkle_packed", {"cp_size": 2}, FULL_RECOMPUTE),
    "qwen35_local_selective_packed": ("qwen35_local_packed", {"cp_size": 2}, SELECTIVE),
    "moe_cp2_ep2_twinkle_packed": ("qwen35_moe_twinkle_packed", {"cp_size": 2, "ep_size": 2}, {}),
    "cp2_tp2sp_local_packed": ("qwen35_local_packed", TP2SP, {}),
    "cp2_tp2sp_twinkle_packed": ("qwen35_twinkle_packed", TP2SP, {}),
    "cp2_pp2_local_packed": ("qwen35_local_packed", {"cp_size": 2, "pp_size": 2}, {}),
    "cp2_pp2_twinkle_packed": ("qwen35_twinkle_packed", {"cp_size": 2, "pp_size": 2}, {}),
    "next_cp2_tp2sp_twinkle_packed": ("next_twinkle_packed", TP2SP, {}),
}
RECOMPUTE = {n: v for n, v in LAYOUTS.items() if v[1] == {"cp_size": 2}}          # 2 ranks, weights too
TWO_MORE = {n: v for n, v in LAYOUTS.items() if "ep_size" in v[1]}               # 2 ranks
FOUR = {n: v for n, v in LAYOUTS.items() if n not in RECOMPUTE and n not in TWO_MORE}   # 4 ranks


def _base(name):
    """The single-process run (a :data:`RUNS` name) that run ``name`` must equal."""
    return LAYOUTS[name][0] if name in LAYOUTS else name


def _run(name, dirs):
    if name in LAYOUTS:
        ref, mesh, kwargs = LAYOUTS[name]
        return dict(_run(ref, dirs), name=name, mesh=mesh, model_kwargs=kwargs, weights=name in RECOMPUTE)
    model, twinkle, lora, *packing = RUNS[name]
    return {"name": name, "model_dir": dirs[model], "twinkle": twinkle, "lora": lora,
            "packing": packing[0] if packing else None}


def _seq(name) -> int:
    """The row length of run ``name``."""
    packing = _run(name, {m: None for m in ("qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen3")})["packing"]
    return sum(packing[0]) if packing else SPEC["seq"]


@pytest.fixture(scope="module")
def single(model_dirs):
    from tests.megatron_workers.gdn_cp_worker import build, gdn_kinds, gkd_step, logps, topk, train, weights
    out = {}
    with megatron_one_rank() as tm:
        for name in RUNS:
            model = build(_run(name, model_dirs), SPEC, tm.DeviceMesh.from_sizes(world_size=1))
            run = _run(name, model_dirs)
            losses, norms = train(model, SPEC, run)
            out[name] = {"losses": losses, "norms": norms, "weights": weights(model), "kinds": gdn_kinds(model),
                         "logps": torch.tensor(logps(model, SPEC, run))}
            if run["packing"]:
                out[name]["topk"] = topk(model, SPEC, run)
                out[name]["gkd"] = gkd_step(model, SPEC, run)
    return out


@pytest.fixture(scope="module")
def cp2(model_dirs):
    runs = [dict(_run(name, model_dirs), mesh={"cp_size": 2}) for name in RUNS]
    runs += [_run(name, model_dirs) for name in list(RECOMPUTE) + list(TWO_MORE)]
    runs.append(dict(_run("qwen35_twinkle", model_dirs), name="contiguous", mesh={"cp_size": 2}, contiguous=True))
    runs.append({"name": "attention_packed", "mesh": {"cp_size": 2}, "packings": ATTENTION_PACKINGS})
    # packed boundary cu_seqlens[3] (18, inside rank 1's chunk [16, 32); 30, where micro-batch 2's
    # 30-token sample starts) one token late in what the model sees
    runs.append(dict(_run("qwen35_twinkle_packed", model_dirs), name="boundary_off_by_one", mesh={"cp_size": 2},
                     shift_boundary=3))
    workdir = str(model_dirs["root"] / "cp2")
    results, codes, logs, elapsed = launch(2, dict(SPEC, runs=runs), workdir, timeout=400, script=WORKER)
    assert codes == [0, 0] and all(r is not None for r in results), "\n".join(t[-3000:] for t in logs)
    print(f"[CP2, {len(runs)} runs on 2 ranks: {elapsed:.1f}s]")
    return results, workdir


@pytest.fixture(scope="module")
def four(model_dirs):
    workdir = str(model_dirs["root"] / "four")
    runs = [_run(name, model_dirs) for name in FOUR]
    results, codes, logs, elapsed = launch(4, dict(SPEC, runs=runs), workdir, timeout=500, script=WORKER)
    assert codes == [0] * 4 and all(r is not None for r in results), "\n".join(t[-3000:] for t in logs)
    print(f"[CP2 x TP2 / PP2, {len(runs)} runs on 4 ranks: {elapsed:.1f}s]")
    return results


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def _check_topk(rec: dict, ref: dict, name: str, rank: int):
    """Packed runs: forward_only(return_topk=3)'s [B, S, 3] log-probs within 1e-6 of the largest and
    the same ids as the single-process run's (the GKD teacher's outputs follow the packed CP layout),
    and a GKD step's loss and grad norm within 1e-6 (the student's logits at the teacher's ids)."""
    if "topk" not in ref:
        return
    gkd = [_rel(a, b) for a, b in zip(rec["gkd"], ref["gkd"])]
    print(f"[{name} rank {rank}: GKD step loss {gkd[0]:.1e}, grad norm {gkd[1]:.1e} relative]")
    assert max(gkd) <= RTOL, (name, rank, rec["gkd"], ref["gkd"])
    mine, want = rec["topk"], ref["topk"]
    lp, want_lp = torch.tensor(mine["logps"]), torch.tensor(want["logps"])
    assert lp.shape == want_lp.shape == (SPEC["batch"], _seq(name), 3), lp.shape
    rel = float((lp - want_lp).abs().max() / want_lp.abs().max())
    print(f"[{name} rank {rank}: forward_only top-3 log-probs {rel:.1e} relative, ids equal]")
    assert rel <= RTOL and mine["ids"] == want["ids"], (name, rank, rel)


def _weights_rel(mine: dict, ref: dict, keys):
    """The largest ``||a - b|| / ||b||`` over the parameters ``keys``, and its name, and the same over
    them all as one vector. (Elementwise, an entry whose gradient is all rounding noise, which Adam
    turns into a full-size step, would decide.)"""
    worst = max((float((mine[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-30)), k) for k in keys)
    whole = (sum(float((mine[k] - ref[k]).pow(2).sum()) for k in keys)
             / max(sum(float(ref[k].pow(2).sum()) for k in keys), 1e-30)) ** 0.5
    return worst, whole


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(RUNS) + list(RECOMPUTE))
def test_cp2_training_equals_single_process(single, cp2, name):
    results, workdir = cp2
    ref = single[_base(name)]
    for rank in (0, 1):
        rec = results[rank][name]
        assert rec["ok"], rec.get("traceback")
        assert rec["kinds"] == ref["kinds"], (rec["kinds"], ref["kinds"])
        twinkle = RUNS[_base(name)][1]
        gdn = [] if RUNS[_base(name)][0] == "qwen3" else ["TwinkleGatedDeltaNet" if twinkle else "LocalGatedDeltaNet"]
        assert rec["kinds"] == gdn, rec["kinds"]
        loss_rel = max(_rel(a, b) for a, b in zip(rec["losses"], ref["losses"]))
        norm_rel = max(_rel(a, b) for a, b in zip(rec["norms"], ref["norms"]))
        w = torch.load(os.path.join(workdir, f"weights_{name}_{rank}.pt"))
        assert w.keys() == ref["weights"].keys(), sorted(set(w) ^ set(ref["weights"]))
        lora = RUNS[_base(name)][2] is not None
        trained = [k for k in w if ".lora." in k] if lora else list(w)
        for k in set(w) - set(trained):   # the frozen base under an adapter
            assert torch.equal(w[k], ref["weights"][k]), k
        (w_rel, worst), whole = _weights_rel(w, ref["weights"], trained)
        print(f"[{name} rank {rank}: loss {loss_rel:.1e}, grad norm {norm_rel:.1e}, weights {whole:.1e} "
              f"relative as one vector, {w_rel:.1e} at worst ({worst})]")
        # forward_only after training: the full [B, S] log-probs on every CP rank
        lp = torch.tensor(rec["logps"])
        assert lp.shape == ref["logps"].shape == (SPEC["batch"], _seq(name)), lp.shape
        lp_rel = float((lp - ref["logps"]).abs().max() / ref["logps"].abs().max())
        print(f"[{name} rank {rank}: forward_only log-probs {lp_rel:.1e} relative to the largest]")
        _check_topk(rec, ref, name, rank)
        assert len(rec["losses"]) == len(ref["losses"]) == SPEC["steps"]
        assert loss_rel <= RTOL and norm_rel <= RTOL and whole <= RTOL and lp_rel <= RTOL, \
            (name, rank, loss_rel, norm_rel, whole, lp_rel)
        # each tensor: 1e-6, but a LoRA B factor (zero at the start, two Adam steps later) of an
        # attention projection: 2e-6 there, where local and twinkle kernels in one process differ by 2.3e-6
        assert w_rel <= (1e-5 if lora else RTOL), (name, rank, w_rel, worst)


@pytest.mark.multiprocess
def test_contiguous_shards_are_wrong(single, cp2):
    """The layer told that each rank holds one contiguous shard of each row (not chunks r and
    2cp - 1 - r) runs, but gives another model: the equality above is not vacuous."""
    results, _ = cp2
    rec, ref = results[0]["contiguous"], single["qwen35_twinkle"]
    assert rec["ok"], rec.get("traceback")
    loss_rel = max(_rel(a, b) for a, b in zip(rec["losses"], ref["losses"]))
    print(f"\n[contiguous shards: loss {loss_rel:.1e} relative]")
    assert loss_rel > 1e-3, (rec["losses"], ref["losses"])


# The CP attention alone, rows of 32 tokens on CP2 (chunks of 8): samples across chunk boundaries,
# inside one, one token each, a single sample, boundaries on the chunk boundaries
ATTENTION_PACKINGS = {"cross": [6, 12, 1, 13], "inside": [2, 3, 1, 1, 25], "one": [32], "ones": [1] * 32,
                      "edges": [8, 8, 16]}


@pytest.mark.multiprocess
def test_packed_context_parallel_attention(cp2):
    """``ContextParallelAttention`` on packed THD rows under CP2, with and without a sliding window
    of 5: each rank's output and its q / k / v gradients equal per-sample causal attention of the
    whole row in float64 (fp32 rounding: 1e-6 of the largest)."""
    results, _ = cp2
    worst = {"out": 0.0, "grads": 0.0}
    for rank in (0, 1):
        rec = results[rank]["attention_packed"]
        assert rec["ok"], rec.get("traceback")
        assert len(rec["attention"]) == 2 * len(ATTENTION_PACKINGS)
        for case, errs in rec["attention"].items():
            assert errs["out"] <= 1e-6 and errs["grads"] <= 1e-6, (rank, case, errs)
            worst = {k: max(worst[k], errs[k]) for k in worst}
    print(f"\n[packed CP attention: outputs {worst['out']:.1e}, gradients {worst['grads']:.1e} relative]")


@pytest.mark.multiprocess
def test_packed_boundary_off_by_one_is_wrong(single, cp2):
    """One packed boundary one token late in what the CP model sees (the loss's samples unchanged)
    runs, but gives another model: the packed equality above places every boundary to the token."""
    results, _ = cp2
    ref = single["qwen35_twinkle_packed"]
    for rank in (0, 1):
        rec = results[rank]["boundary_off_by_one"]
        assert rec["ok"], rec.get("traceback")
        loss_rel = max(_rel(a, b) for a, b in zip(rec["losses"], ref["losses"]))
        lp = torch.tensor(rec["logps"])
        lp_rel = float((lp - ref["logps"]).abs().max() / ref["logps"].abs().max())
        print(f"\n[packed boundary one token off, rank {rank}: loss {loss_rel:.1e}, log-probs {lp_rel:.1e} relative]")
        assert loss_rel > 1e-4 and lp_rel > 1e-3, (rec["losses"], ref["losses"], lp_rel)


def test_packed_cp_bounds_refuse_local_cu_seqlens():
    """Boundaries divided by cp (the rank's own token count) or of another row length are refused,
    naming cu_seqlens, before any attention runs; the RoPE positions restart at every sample."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from twinkle_megatron.layers.attention import cp_packed_bounds, cp_packed_positions, cp_positions
    cu = torch.tensor([0, 5, 6, 18, 30, 33, 47, 60, 64], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=14, max_seqlen_kv=14)
    assert torch.equal(cp_packed_bounds(params, 32, 2), cu.long())
    for wrong in (cu // 2, cu[:-1]):
        bad = PackedSeqParams(qkv_format="thd", cu_seqlens_q=wrong, cu_seqlens_kv=wrong)
        with pytest.raises(ValueError, match="cu_seqlens"):
            cp_packed_bounds(bad, 32, 2)
    # positions: each global token's offset in its sample, read by hand from the boundaries
    for rank in (0, 1):
        idx = cp_positions(32, rank, 2)
        want = torch.tensor([int(i) - max(int(c) for c in cu if c <= i) for i in idx])
        assert torch.equal(cp_packed_positions(cu, 32, rank, 2), want)
    assert cp_packed_positions(cu, 32, 1, 2)[:4].tolist() == [10, 11, 0, 1]   # tokens 16..19: 18 starts a sample



@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(TWO_MORE) + list(FOUR))
def test_cp2_with_ep2_tp2_sp_or_pp2_equals_single_process(single, request, name):
    """CP2 x EP2 on 2 ranks; on 4 ranks CP2 x TP2 with sequence parallelism (the GDN heads split
    over TP, each TP rank passing its heads' states over its CP group) and CP2 x PP2. Losses, grad
    norms and forward_only's log-probs, on every rank."""
    ref = single[_base(name)]
    results = request.getfixturevalue("cp2")[0] if name in TWO_MORE else request.getfixturevalue("four")
    for rank in range(len(results)):
        rec = results[rank][name]
        assert rec["ok"], rec.get("traceback")
        loss_rel = max(_rel(a, b) for a, b in zip(rec["losses"], ref["losses"]))
        norm_rel = max(_rel(a, b) for a, b in zip(rec["norms"], ref["norms"]))
        lp = torch.tensor(rec["logps"])
        assert lp.shape == ref["logps"].shape, lp.shape   # every rank, as without CP
        lp_rel = float((lp - ref["logps"]).abs().max() / ref["logps"].abs().max())
        print(f"[{name} rank {rank}: loss {loss_rel:.1e}, grad norm {norm_rel:.1e}, forward_only log-probs "
              f"{lp_rel:.1e} relative]")
        assert lp_rel <= RTOL, (name, rank, lp_rel)
        _check_topk(rec, ref, name, rank)
        assert len(rec["losses"]) == SPEC["steps"]
        assert loss_rel <= RTOL and norm_rel <= RTOL, (name, rank, rec["losses"], ref["losses"], rec["norms"],
                                                      ref["norms"])
