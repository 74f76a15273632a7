"""Activation recompute and DDP communication overlap on ``MegatronModel`` (real megatron-core,
gloo).

Recompute (selective; full with the uniform and the block method) must train exactly like no
recompute: the same losses and pre-clip grad norms over three steps, within 1e-6, for the dense
Qwen3 and the Qwen3.5 hybrid (whose Gated DeltaNet layers full recompute reruns), LoRA on,
in one process, under PP2 and under TP2 + SP, with ``use_twinkle_kernels`` and the fused LM-head
loss in one layout of each model, and under CP2; with LoRA dropout as well (the rerun draws the
same masks: the RNG states are restored). The overlap switches reach megatron's DDP
config and distributed optimizer under DP2 and train as without them, on CPU too (several bucket
sizes, with and without the distributed optimizer); the weights read outside a forward after a
step are every rank's update; with overlap_grad_reduce a second forward_backward before the step
is refused; the CPU mode's coalescing handle waits for the bucket all-reduces.
Bad arguments: errors naming them. (tests/megatron_workers/recompute_worker.py runs the ranks.)
"""
import os

import pytest
import torch

pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")

from tests.megatron_workers.protocol import ROOT, launch  # noqa: E402

WORKER = os.path.join(ROOT, "tests", "megatron_workers", "recompute_worker.py")
VOCAB, SEQ, B = 128, 16, 4
TOL = 1e-6

DENSE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
             max_position_embeddings=64, intermediate_size=128, num_hidden_layers=4, head_dim=16,
             tie_word_embeddings=False)
HYBRID = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_conv_kernel_dim=4,
              linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
              layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                               "mrope_section": [1, 1, 0], "mrope_interleaved": True},
              max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False)

NONE = {}
SEL = {"recompute_granularity": "selective", "recompute_modules": ["core_attn", "mlp"]}
SEL_DEFAULT = {"recompute_granularity": "selective"}


def full(method, n):
    return {"recompute_granularity": "full", "recompute_method": method, "recompute_num_layers": n}


TK = {"use_twinkle_kernels": True, "fused_linear_ce": True}


def with_kernels(configs):
    return {k: dict(v, **TK) for k, v in configs.items()}


ONE = [
    {"name": "dense_lora", "model": "dense", "lora": True,
     "configs": {"none": NONE, "selective": SEL, "full_uniform": full("uniform", 2), "full_block": full("block", 3)}},
    # dropout too: the rerun restores the RNG states (on CPU the compatibility layer's CPU generator)
    {"name": "dense_lora_dropout", "model": "dense", "lora": True, "lora_dropout": 0.3,
     "configs": {"none": NONE, "selective": {"recompute_granularity": "selective", "recompute_modules": ["mlp"]},
                 "full_uniform": full("uniform", 1)}},
    {"name": "dense_kernels", "model": "dense", "mbs": 2,
     "configs": with_kernels({"none": NONE, "selective": SEL, "full_uniform": full("uniform", 4)})},
    {"name": "hybrid_kernels_lora", "model": "hybrid", "lora": True,
     "configs": with_kernels({"none": NONE, "selective": SEL_DEFAULT, "full_uniform": full("uniform", 1),
                              "full_block": full("block", 2)})},
]
TWO = [
    {"name": "pp2_dense_lora", "model": "dense", "lora": True, "mesh": {"pp_size": 2}, "mbs": 2,
     "configs": {"none": NONE, "selective": SEL, "full_uniform": full("uniform", 1), "full_block": full("block", 1)}},
    {"name": "pp2_hybrid_lora", "model": "hybrid", "lora": True, "mesh": {"pp_size": 2}, "mbs": 1,
     "configs": {"none": NONE, "full_uniform": full("uniform", 2), "full_block": full("block", 1)}},
    {"name": "tp2_sp_dense_lora", "model": "dense", "lora": True, "mesh": {"tp_size": 2, "sequence_parallel": True},
     "configs": with_kernels({"none": NONE, "selective": SEL, "full_uniform": full("uniform", 1),
                              "full_block": full("block", 2)})},
    {"name": "tp2_sp_hybrid_lora", "model": "hybrid", "lora": True, "mesh": {"tp_size": 2, "sequence_parallel": True},
     "configs": {"none": NONE, "selective": SEL, "full_block": full("block", 1)}},
    {"name": "cp2_dense", "model": "dense", "mesh": {"cp_size": 2},
     "configs": {"none": NONE, "full_uniform": full("uniform", 1)}},
    {"name": "dp2_overlap", "model": "dense", "mesh": {"dp_size": 2}, "overlap": True, "mbs": 1,
     "configs": {"none": NONE,
                 "grad_reduce": {"overlap_grad_reduce": True, "bucket_size": 20000},
                 "grad_reduce_small": {"overlap_grad_reduce": True, "bucket_size": 5000},
                 "distopt": {"use_distributed_optimizer": True},
                 "distopt_overlap": {"use_distributed_optimizer": True, "overlap_grad_reduce": True,
                                     "overlap_param_gather": True, "bucket_size": 20000},
                 "distopt_grad_reduce_small": {"use_distributed_optimizer": True, "overlap_grad_reduce": True,
                                               "bucket_size": 5000}}},
]
for r in ONE:
    r["mesh"] = {"world_size": 1}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("recompute")
    dirs = {"dense": str(root / "dense"), "hybrid": str(root / "hybrid")}
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(**DENSE)).float().save_pretrained(dirs["dense"])
    torch.manual_seed(0)
    hybrid = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**HYBRID)).float()
    with torch.no_grad():   # norms and dt_bias off their ones / zeros init, as a trained model's
        for name, p in hybrid.named_parameters():
            if "norm" in name or "dt_bias" in name:
                p.normal_(0.0, 0.3)
    hybrid.save_pretrained(dirs["hybrid"])
    g = torch.Generator().manual_seed(5)
    torch.save({"ids": torch.randint(0, VOCAB, (B, SEQ), generator=g)}, str(root / "data.pt"))
    out = {}
    for n, runs in ((1, ONE), (2, TWO)):
        spec = {"data": str(root / "data.pt"), "model_dirs": dirs, "runs": runs}
        res, rcs, logs, elapsed = launch(n, spec, str(root / f"run{n}"), timeout=400, script=WORKER)
        assert rcs == [0] * n and all(r is not None for r in res), "\n".join(l[-3000:] for l in logs)
        print(f"[{n} ranks: {elapsed:.1f}s]")
        for rank, r in enumerate(res):
            for name, rec in r.items():
                assert rec.get("ok"), f"{name} rank {rank}: {rec.get('traceback', rec)}"
                out[(name, rank)] = rec
    return out


RECOMPUTE_RUNS = [(r["name"], c, rank) for runs, n in ((ONE, 1), (TWO, 2)) for r in runs if not r.get("overlap")
                  for c in r["configs"] if c != "none" for rank in range(n)]


@pytest.mark.parametrize("run,config,rank", RECOMPUTE_RUNS, ids=[f"{a}-{b}-r{c}" for a, b, c in RECOMPUTE_RUNS])
def test_recompute_equals_no_recompute(results, run, config, rank):
    rec, ref = results[(run, rank)][config], results[(run, rank)]["none"]
    # the adapters must learn (a recomputed segment with a frozen input would leave them at zero grad)
    assert all(n > 1e-3 for n in ref["norms"]), ref["norms"]
    assert ref["losses"][2] < ref["losses"][0]
    for key in ("losses", "norms"):
        got, want = torch.tensor(rec[key], dtype=torch.float64), torch.tensor(ref[key], dtype=torch.float64)
        assert torch.allclose(got, want, rtol=TOL, atol=TOL), f"{key}: {rec[key]} != {ref[key]}"
    granularity = rec["recompute"][0]
    assert granularity == config.split("_")[0]
    assert f"recompute: {granularity}" in rec["configs"]
    # and it did recompute: the recomputed modules ran again in the backward
    calls, base = rec["calls"], ref["calls"]
    hybrid = "hybrid" in run
    assert base["layer"] > 0 and (base["gdn"] > 0) == hybrid
    if granularity == "full":
        assert calls["layer"] > base["layer"]
        assert not hybrid or calls["gdn"] > base["gdn"]   # the delta rule reran
    else:
        modules = rec["recompute"][3]
        assert calls["layer"] == base["layer"] and calls["gdn"] == base["gdn"]
        assert calls["core_attention"] == (2 if "core_attn" in modules else 1) * base["core_attention"] > 0
        assert calls["mlp"] == (2 if "mlp" in modules else 1) * base["mlp"]


def test_recompute_reaches_megatron(results):
    rec = results[("dense_lora", 0)]
    assert rec["none"]["recompute"] == [None, None, None, ["core_attn"]] and "recompute: off" in rec["none"]["configs"]
    assert rec["selective"]["recompute"] == ["selective", None, None, ["core_attn", "mlp"]]
    assert rec["full_block"]["recompute"] == ["full", "block", 3, []]
    assert "recompute: full method=block layers=3" in rec["full_block"]["configs"]
    assert results[("hybrid_kernels_lora", 0)]["selective"]["recompute"][3] == ["core_attn"]


OVERLAP = {"grad_reduce": ("none", 20000, False), "grad_reduce_small": ("none", 5000, False),
           "distopt_overlap": ("distopt", 20000, True), "distopt_grad_reduce_small": ("distopt", 5000, False)}


@pytest.mark.parametrize("rank", [0, 1])
def test_overlap_switches_reach_ddp_and_train_the_same(results, rank):
    """overlap_grad_reduce runs on CPU too: with 20000 parameters per bucket (7 buckets here) and
    5000 (14), with and without the distributed optimizer, three steps give the losses, grad norms
    and weights of the same run without overlap (before the CPU mode waited for the bucket
    all-reduces, 20000 gave a first grad norm of 2.69 instead of 2.79, by timing)."""
    rec = results[("dp2_overlap", rank)]
    assert rec["none"]["ddp"] == {"overlap_grad_reduce": False, "overlap_param_gather": False,
                                  "bucket_size": None, "use_distributed_optimizer": False}
    for name, (ref, bucket, gather) in OVERLAP.items():
        assert rec[name]["ddp"] == {"overlap_grad_reduce": True, "overlap_param_gather": gather,
                                    "bucket_size": bucket, "use_distributed_optimizer": ref == "distopt"}
        assert f"ddp: overlap_grad_reduce=True overlap_param_gather={gather} bucket_size={bucket}" \
            in rec[name]["configs"]
        for key in ("losses", "norms"):
            assert torch.allclose(torch.tensor(rec[name][key], dtype=torch.float64),
                                  torch.tensor(rec[ref][key], dtype=torch.float64), rtol=TOL, atol=0), (name, key)
        assert abs(rec[name]["weights"] - rec[ref]["weights"]) <= 1e-6 * abs(rec[ref]["weights"])
        # megatron reduces each bucket as its grads complete: a second call would lose grads
        assert "one forward_backward per optimizer step" in rec[name]["second_call"]
    assert rec["none"]["second_call"] == rec["distopt"]["second_call"] == "accepted"
    # every rank holds every rank's update once the facade finished the in-flight param gathers
    # (without that, each rank's weights outside its own shard are one step old)
    other = results[("dp2_overlap", 1 - rank)]
    assert rec["distopt_overlap"]["weights"] == other["distopt_overlap"]["weights"]


@pytest.mark.parametrize("rank", [0, 1])
def test_coalesced_handle_waits_for_the_bucket_all_reduce(results, rank):
    """The mechanism of the overlap bug, deterministic: on CPU megatron's ``_coalescing_manager``
    is the CPU mode's, and the handle it yields (what ``finish_grad_sync`` waits on) must wait
    for an asynchronous all-reduce issued in its block; before the fix it returned at once, and a
    16 MB all-reduce read right after was unreduced."""
    assert results[("dp2_overlap", rank)]["coalesced_wait"] is True


def test_one_forward_backward_per_step_with_overlapped_grad_reduce():
    from twinkle_megatron.parallel import ddp
    on = ddp.OverlapOptions(overlap_grad_reduce=True)
    ddp.check_overlap_call(on, None)
    ddp.check_overlap_call(ddp.OverlapOptions(), torch.tensor(5))
    with pytest.raises(RuntimeError, match="one forward_backward per optimizer step"):
        ddp.check_overlap_call(on, torch.tensor(5))


# ---- bad arguments (no process group needed) ---------------------------------------------------

def _check(layers=4, **kwargs):
    from twinkle_megatron import config
    from twinkle_megatron.parallel.mesh import DeviceMesh
    shape = config.model_shape(dict(DENSE, model_type="qwen3", num_hidden_layers=layers))
    return config.recompute_fields(shape, DeviceMesh.from_sizes(world_size=4, pp_size=2), **kwargs)


@pytest.mark.parametrize("kwargs,match", [
    ({"granularity": "everything"}, "recompute_granularity must be"),
    ({"granularity": "full"}, "needs recompute_method='uniform' or 'block'"),
    ({"granularity": "full", "method": "uniform"}, "recompute_num_layers between 1 and the 2 layers"),
    ({"granularity": "full", "method": "block", "num_layers": 3}, "recompute_num_layers between 1 and the 2"),
    ({"granularity": "full", "method": "uniform", "num_layers": 0}, "recompute_num_layers between"),
    ({"granularity": "full", "method": "uniform", "num_layers": 1, "modules": ["mlp"]}, "recompute_modules=.*selective"),
    ({"granularity": "selective", "num_layers": 1}, "recompute_num_layers=1 applies to recompute_granularity='full'"),
    ({"granularity": "selective", "method": "block"}, "recompute_method='block' applies"),
    ({"granularity": "selective", "modules": ["attention"]}, "unknown module 'attention'"),
    ({"granularity": "selective", "modules": []}, "recompute_modules is empty"),
    ({"granularity": "selective", "modules": ["moe"]}, "'moe' needs an MoE model"),
    ({"granularity": "selective", "modules": ["moe_act"]}, "'moe_act' needs grouped-GEMM"),
    ({"granularity": "selective", "modules": ["layernorm"]}, "'layernorm' needs TransformerEngine"),
    ({"granularity": "selective", "modules": ["gdn_norm_out"]}, "'gdn_norm_out' needs megatron's own Gated DeltaNet"),
    ({"method": "uniform"}, "recompute_method='uniform' needs recompute_granularity"),
    ({"modules": ["core_attn"]}, "recompute_modules=.* needs recompute_granularity"),
])
def test_bad_recompute_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _check(**kwargs)


def test_recompute_arguments_checked():
    with pytest.raises(TypeError, match="recompute_modules must be a list"):
        _check(granularity="selective", modules="core_attn")
    with pytest.raises(ValueError, match="recompute_num_layers=2 must divide the 3 layers"):
        _check(layers=6, granularity="full", method="uniform", num_layers=2)
    assert _check(granularity="full", method="uniform", num_layers=2) == {
        "recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 2, "recompute_modules": []}
    assert _check() == {}


@pytest.mark.parametrize("make,flat,match,err", [
    (lambda o: o.PrecisionConfig("bf17"), dict(mixed_precision="bf17"), "mixed_precision must be one of", ValueError),
    (lambda o: o.PrecisionConfig(16), dict(mixed_precision=16), "mixed_precision must be one of", ValueError),
    (lambda o: o.RecomputeConfig("everything"), dict(recompute_granularity="everything"),
     "recompute_granularity must be", ValueError),
    (lambda o: o.RecomputeConfig(method="block"), dict(recompute_method="block"),
     "recompute_method='block' needs recompute_granularity", ValueError),
    (lambda o: o.RecomputeConfig("selective", modules="core_attn"),
     dict(recompute_granularity="selective", recompute_modules="core_attn"), "recompute_modules must be a list",
     TypeError),
    (lambda o: o.RecomputeConfig("full", "uniform", "two"),
     dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers="two"),
     "recompute_num_layers between 1", ValueError),
    (lambda o: o.OverlapOptions(1), dict(overlap_grad_reduce=1), "overlap_grad_reduce must be a bool", TypeError),
    (lambda o: o.OverlapOptions(bucket_size=True), dict(bucket_size=True), "bucket_size must be a positive int",
     ValueError),
])
def test_config_objects_check_themselves_as_the_flat_keywords(make, flat, match, err):
    """The three settings objects live in twinkle_megatron.options and check themselves when made;
    MegatronModel's flat keywords build the same object, so both are refused with the same error
    (before anything is initialised: no model folder is read)."""
    import twinkle_megatron as tm
    from twinkle_megatron import options
    with pytest.raises(err, match=match):
        make(options)
    with pytest.raises(err, match=match):
        tm.MegatronModel(model_dir_or_config={"model_type": "qwen3"}, device_mesh=tm.DeviceMesh.from_sizes(), **flat)
    assert (tm.PrecisionConfig, tm.RecomputeConfig, tm.OverlapOptions) == options.CONFIGS
    from twinkle_megatron import config, model
    from twinkle_megatron.parallel import ddp
    assert ddp.OverlapOptions is options.OverlapOptions and config.RecomputeConfig is options.RecomputeConfig
    assert model.PrecisionConfig is options.PrecisionConfig  # the old homes still import


def test_recompute_config_keeps_distinct_module_names():
    from twinkle_megatron.options import RecomputeConfig
    assert RecomputeConfig("selective").modules == ("core_attn",)
    assert RecomputeConfig("selective", modules=["mlp", "core_attn", "mlp"]).modules == ("mlp", "core_attn")
    assert RecomputeConfig("selective", modules=["mlp"]) == RecomputeConfig("selective", modules=("mlp",))


def test_bad_overlap_arguments():
    from twinkle_megatron.parallel import ddp
    with pytest.raises(TypeError, match="overlap_grad_reduce must be a bool"):
        ddp.overlap_options(1)
    with pytest.raises(TypeError, match="overlap_param_gather must be a bool"):
        ddp.overlap_options(False, "yes")
    with pytest.raises(ValueError, match="bucket_size must be a positive int"):
        ddp.overlap_options(bucket_size=0)
    opts = ddp.overlap_options(True, True, 1000)
    assert (opts.overlap_grad_reduce, opts.overlap_param_gather, opts.bucket_size) == (True, True, 1000)
    assert "overlap_param_gather applies to the distributed optimizer only" in opts.describe(False)
    assert opts.describe(True) == "ddp: overlap_grad_reduce=True overlap_param_gather=True bucket_size=1000"
    assert "bucket_size applies with overlap_grad_reduce only" in ddp.overlap_options(bucket_size=10).describe(True)


def test_train_job_flags():
    from twinkle_megatron.job.job import memory_kwargs, parse_args
    off = {"overlap_grad_reduce": False, "overlap_param_gather": False, "bucket_size": None}
    assert memory_kwargs(parse_args([])) == off
    assert memory_kwargs(parse_args(["--recompute", "full"])) == dict(
        off, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    assert memory_kwargs(parse_args(["--recompute", "full", "--recompute-method", "block",
                                     "--recompute-num-layers", "2", "--overlap-grad-reduce",
                                     "--bucket-size", "1000"])) == dict(
        off, overlap_grad_reduce=True, bucket_size=1000, recompute_granularity="full", recompute_method="block",
        recompute_num_layers=2)
    assert memory_kwargs(parse_args(["--recompute", "selective", "--recompute-modules", "core_attn,mlp",
                                     "--overlap-param-gather"])) == dict(
        off, overlap_param_gather=True, recompute_granularity="selective", recompute_modules=["core_attn", "mlp"])
    with pytest.raises(SystemExit, match="--recompute-modules does not apply to --recompute full"):
        memory_kwargs(parse_args(["--recompute", "full", "--recompute-modules", "mlp"]))
    with pytest.raises(SystemExit, match="--recompute-num-layers does not apply to --recompute none"):
        memory_kwargs(parse_args(["--recompute-num-layers", "2"]))
