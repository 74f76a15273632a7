"""twinkle_megatron on real megatron-core 0.16.1, CPU + gloo.

In-process: the CPU device mode (canary + exact revert), mesh validation, input validation.
Multi-process (tests/megatron_workers/worker.py, one launch per world size, each layout run in turn in the
same processes): the equivalence matrix against a single-process reference, HF round trips,
resume in a fresh process, bad inputs on every rank, and a killed rank not hanging the others.
"""
import json
import math
import os

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

from tests.megatron_workers.protocol import ROOT, launch  # noqa: E402
from twinkle_megatron.parallel.launch import LaunchTimeout  # noqa: E402

VOCAB, SEQ, BATCH = 128, 16, 4
TOL = 1e-5


# ---- in-process ---------------------------------------------------------------------------

def test_cpu_compat_symbols_exist():
    """Canary: every megatron-core symbol the CPU mode patches or relies on is still there."""
    from twinkle_megatron.parallel import cpu_compat
    missing = []
    for path in cpu_compat.patched_symbols():
        try:
            cpu_compat._resolve(path)
        except (ImportError, AttributeError):
            missing.append(path)
    assert not missing, f"megatron-core moved these symbols: {missing}"


def test_cpu_compat_apply_revert_is_exact():
    import sys
    from twinkle_megatron.parallel import cpu_compat
    for name in cpu_compat._MODULES:
        __import__(name)
    before = {n: dict(vars(m)) for n, m in sys.modules.items()
              if m is not None and n.startswith("megatron.core")}
    tensor_type, tensor_cuda = torch.Tensor.type, torch.Tensor.cuda
    assert not cpu_compat.is_applied()
    cpu_compat.apply()
    try:
        cpu_compat.apply()   # idempotent
        from megatron.core.pipeline_parallel import schedules
        from megatron.core.models.common.embeddings import rope_utils
        assert schedules.torch is not torch
        assert schedules.torch.zeros([], device="cuda").device.type == "cpu"
        assert not rope_utils.torch.tensor([1], device="cpu", pin_memory=True).is_pinned()
        assert schedules.torch.cuda.current_device() == torch.device("cpu")
    finally:
        cpu_compat.revert()
    assert torch.Tensor.type is tensor_type and torch.Tensor.cuda is tensor_cuda
    for n, saved in before.items():
        now = vars(sys.modules[n])
        changed = [k for k in saved if now.get(k, object()) is not saved[k]]
        assert not changed, f"{n}: not restored: {changed}"
        assert set(now) - set(saved) == set(), f"{n}: left new names"


def test_cpu_compat_drops_only_the_rng_trackers_cpu_alarm():
    """Item 10: in the CPU mode the RNG tracker's ``fork()`` draws on the CPU generator by design,
    so its "CPU RNG state changed" alarm is dropped while the mode is applied (its other records
    pass) and the logger's filters are restored by ``revert()``."""
    import logging
    from twinkle_megatron.parallel import cpu_compat
    log = logging.getLogger("megatron.core.tensor_parallel.random")
    before = list(log.filters)

    def passes(message):
        return bool(log.filter(log.makeRecord(log.name, logging.WARNING, __file__, 0, message, (), None)))

    alarm = "CPU RNG state changed within GPU RNG context"
    assert not cpu_compat.is_applied() and passes(alarm)
    cpu_compat.apply()
    try:
        assert not passes(alarm)
        assert passes("cuda rng state model-parallel-rng is not added")
    finally:
        cpu_compat.revert()
    assert log.filters == before and passes(alarm)


def test_cpu_compat_grad_norm_is_accurate_for_large_tensors():
    """megatron's clip_grads L2 norm in CPU mode (cpu_compat item 9) against float64: a
    2**22-element gradient of small values with a few large ones, where torch's CPU float32
    ``torch.norm`` (megatron's fallback without TE / apex) is ~1e-3 low; with many small
    tensors (summed together) and a bf16 one between them."""
    from megatron.core.optimizer import clip_grads
    from twinkle_megatron.parallel import cpu_compat
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(2048, 2048, generator=g) * 1e-3, torch.randn(3, 5, generator=g)]
    grads[0][0, :8] = 5.0
    grads += [torch.randn(7, 11, generator=g) for _ in range(40)] + [torch.randn(9, generator=g).bfloat16()] \
        + [torch.randn(1 << 19, generator=g) for _ in range(3)]
    exact = math.sqrt(sum(float(t.double().pow(2).sum()) for t in grads))
    cpu_compat.apply()
    try:
        norm, _ = clip_grads.multi_tensor_applier(clip_grads.l2_norm_impl, None, [grads], False)
    finally:
        cpu_compat.revert()
    assert abs(float(norm) - exact) <= 1e-12 * exact, (float(norm), exact)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cpu_compat_grad_accumulation_equals_megatrons_add(dtype):
    """cpu_compat item 12: megatron's own DDP backward hook (called with a stand-in DDP) adds a
    gradient into an fp32 ``main_grad`` bit for bit as ``main_grad.add_(grad)``, once, over a
    size that is no multiple of the slice; clears ``param.grad``; leaves ``grad_added_to_main_grad``
    as it was; adds nothing after a fused weight-gradient GEMM (flag set) unless
    ``zero_out_wgrad``; and ignores a parameter outside the buckets."""
    import types
    from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel as DDP
    from twinkle_megatron.parallel import cpu_compat
    g = torch.Generator().manual_seed(1)
    param = torch.nn.Parameter(torch.zeros(3, (1 << 18) + 5, dtype=dtype))
    ddp = types.SimpleNamespace(param_to_bucket_group={param: None},
                                ddp_config=types.SimpleNamespace(overlap_grad_reduce=False),
                                force_all_reduce=False)
    start = torch.randn(param.shape, generator=g)
    grads = [torch.randn(param.shape, generator=g).to(dtype) for _ in range(2)]
    cpu_compat.apply()
    try:
        hook = DDP._make_backward_post_hook(ddp, param)
        other = torch.nn.Parameter(torch.zeros(2, dtype=dtype))
        DDP._make_backward_post_hook(ddp, other)()   # not in a bucket: nothing happens
    finally:
        cpu_compat.revert()
    param.main_grad = start.clone()
    param.grad_added_to_main_grad = False
    expected = start.clone()
    for grad in grads:
        param.grad = grad.clone()
        hook()
        expected.add_(grad)
        assert param.grad is None and param.grad_added_to_main_grad is False
        assert torch.equal(param.main_grad, expected)
    param.grad, param.grad_added_to_main_grad = grads[0].clone(), True
    hook()
    assert torch.equal(param.main_grad, expected) and param.grad_added_to_main_grad is True
    param.grad, param.zero_out_wgrad = grads[0].clone(), True
    hook()
    assert torch.equal(param.main_grad, expected.add_(grads[0]))


@pytest.mark.parametrize("tied", [False, True])
def test_cpu_compat_embedding_grad_goes_into_main_grad(tied):
    """cpu_compat item 13: megatron's ``tensor_parallel.layers.F.embedding`` on a DDP-wrapped bf16
    weight adds the rows' gradients, repeated ids included, into the fp32 ``main_grad`` (float64
    reference); the weight's own gradient is None when tied to the head (``zero_out_wgrad``: the
    head's gradient alone reaches it) and a dummy with ``grad_added_to_main_grad`` otherwise; the
    forward equals torch's; without a ``main_grad``, under no_grad or with an option it is torch's."""
    from megatron.core.tensor_parallel import layers
    from twinkle_megatron.parallel import cpu_compat
    g = torch.Generator().manual_seed(2)
    weight = torch.nn.Parameter(torch.randn(37, 8, generator=g).bfloat16())
    ids = torch.tensor([[3, 5, 3, 36], [0, 5, 5, 3]])
    up = torch.randn(2, 4, 8, generator=g)
    head = torch.randn(37, 8, generator=g).bfloat16()
    start = torch.randn(37, 8, generator=g)
    weight.main_grad, weight.grad_added_to_main_grad = start.clone(), False
    if tied:
        weight.zero_out_wgrad = True
    seen = []
    weight.register_hook(lambda grad: seen.append(grad))
    cpu_compat.apply()
    try:
        out = layers.F.embedding(ids, weight)
        loss = (out.float() * up).sum() + ((weight.float() * head.float()).sum() if tied else 0)
        loss.backward()
        plain = layers.F.embedding(ids, weight, padding_idx=0)
        with torch.no_grad():
            nograd = layers.F.embedding(ids, weight)
    finally:
        cpu_compat.revert()
    assert torch.equal(out, torch.nn.functional.embedding(ids, weight))
    assert plain.grad_fn is not None and "EmbeddingIntoMainGrad" not in type(plain.grad_fn).__name__
    assert nograd.grad_fn is None
    expected = start.double().index_add(0, ids.reshape(-1), up.double().bfloat16().double().reshape(-1, 8))
    assert torch.allclose(weight.main_grad.double(), expected, rtol=0, atol=1e-5)
    if tied:
        assert len(seen) == 1 and torch.equal(seen[0], head) and weight.grad_added_to_main_grad is False
    else:
        assert len(seen) == 1 and seen[0].shape == weight.shape and weight.grad_added_to_main_grad is True


def test_cpu_compat_not_applied_at_import():
    import twinkle_megatron  # noqa: F401
    from twinkle_megatron.parallel import cpu_compat
    assert not cpu_compat.is_applied()


@pytest.mark.parametrize("kwargs, words", [
    (dict(tp_size=2, pp_size=2, world_size=6), ["world_size=6", "tp_size*pp_size*cp_size", "4"]),
    (dict(dp_size=2, tp_size=2, world_size=2), ["dp_size*tp_size*pp_size*cp_size", "world_size=2"]),
    (dict(ep_size=4, world_size=2), ["ep_size*etp_size=4*1", "dp_size*cp_size*tp_size=2*1*1"]),
    (dict(vpp_size=2, world_size=2), ["vpp_size=2", "pp_size=1"]),
    (dict(tp_size=0, world_size=2), ["tp_size"]),
])
def test_mesh_rejects_impossible_sizes(kwargs, words):
    import twinkle_megatron as tm
    with pytest.raises(ValueError) as err:
        tm.DeviceMesh.from_sizes(**kwargs)
    for w in words:
        assert w in str(err.value)


def test_mesh_defaults_and_model_checks():
    import twinkle_megatron as tm
    mesh = tm.DeviceMesh.from_sizes(tp_size=2, pp_size=2, world_size=8, sequence_parallel=True)
    assert (mesh.dp_size, mesh.etp_size, mesh.sequence_parallel) == (2, 1, True)   # etp: upstream's default
    assert not tm.DeviceMesh.from_sizes(world_size=2, sequence_parallel=True).sequence_parallel
    with pytest.raises(ValueError, match=r"num_attention_heads=6 .* tp_size=4"):
        tm.DeviceMesh.from_sizes(tp_size=4, world_size=4).check_model(
            num_attention_heads=6, num_key_value_heads=2, num_layers=4)
    with pytest.raises(ValueError, match=r"num_key_value_heads=2 .* tp_size=4"):
        tm.DeviceMesh.from_sizes(tp_size=4, world_size=4, sequence_parallel=True).check_model(
            num_attention_heads=8, num_key_value_heads=2, num_layers=4)
    with pytest.raises(ValueError, match=r"num_layers=4 .* pp_size\*vpp_size=2\*4=8"):
        tm.DeviceMesh.from_sizes(pp_size=2, vpp_size=4, world_size=2).check_model(
            num_attention_heads=4, num_key_value_heads=2, num_layers=4)
    with pytest.raises(ValueError, match=r"num_experts=3 .* ep_size=2"):
        tm.DeviceMesh.from_sizes(ep_size=2, world_size=2).check_model(
            num_attention_heads=4, num_key_value_heads=2, num_layers=4, num_experts=3)


def test_inputs_are_validated_and_padded():
    from twinkle_megatron.training.batching import to_batch as _to_batch
    with pytest.raises(ValueError, match=r"inputs\['labels'\] has shape \(2, 5\), input_ids has \(2, 6\)"):
        _to_batch({"input_ids": torch.zeros(2, 6, dtype=torch.long), "labels": torch.zeros(2, 5, dtype=torch.long)})
    with pytest.raises(ValueError, match="needs 'input_ids' and 'labels'"):
        _to_batch({"input_ids": torch.zeros(2, 6, dtype=torch.long)})
    with pytest.raises(ValueError, match=r"inputs\[1\]\['labels'\] has length 2"):
        _to_batch([{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}, {"input_ids": [4, 5, 6], "labels": [4, 5]}])
    batch = _to_batch([{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}, {"input_ids": [4], "labels": [-100]}])
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 0, 0]]
    assert batch["labels"].tolist() == [[1, 2, 3], [-100, -100, -100]]


def test_missing_config_is_a_clear_error(tmp_path):
    import twinkle_megatron as tm
    mesh = tm.DeviceMesh.from_sizes(world_size=1)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        tm.MegatronModel(str(tmp_path / "nope"), device_mesh=mesh)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type='gpt2' is not supported"):
        tm.MegatronModel(str(tmp_path), device_mesh=mesh)


# ---- tiny checkpoints ---------------------------------------------------------------------

def _save_hf(config, path):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig
    root = tmp_path_factory.mktemp("hf")
    common = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                  max_position_embeddings=64)
    return {
        "qwen3": _save_hf(Qwen3Config(intermediate_size=128, num_hidden_layers=4, head_dim=16,
                                      tie_word_embeddings=False, **common), str(root / "qwen3")),
        "moe": _save_hf(Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                                       num_experts_per_tok=2, num_hidden_layers=2, head_dim=16,
                                       norm_topk_prob=True, **common), str(root / "moe")),
        "llama": _save_hf(LlamaConfig(intermediate_size=128, num_hidden_layers=2, tie_word_embeddings=True,
                                      **common), str(root / "llama")),
        "qwen2": _save_hf(Qwen2Config(intermediate_size=128, num_hidden_layers=2, tie_word_embeddings=False,
                                      **common), str(root / "qwen2")),
        "root": root,
    }


def _spec(models, runs):
    return {"model_dir": models["qwen3"], "batch": BATCH, "seq": SEQ, "vocab": VOCAB, "runs": runs}


def _run(nprocs, spec, workdir, timeout=300, exit_code=0):
    results, rcs, logs, elapsed = launch(nprocs, spec, str(workdir), timeout=timeout)
    assert all(r is not None for r in results), "a rank wrote no result:\n" + "\n".join(l[-3000:] for l in logs)
    assert rcs == [exit_code] * nprocs, (rcs, "\n".join(l[-3000:] for l in logs))
    print(f"[{nprocs} ranks, {len(spec['runs'])} runs: {elapsed:.1f}s]")
    return results


@pytest.fixture(scope="module")
def single(models, tmp_path_factory):
    d = models
    runs = [
        {"name": "ref", "mesh": {"world_size": 1}, "steps": 3, "mbs": 1, "compare_hf": True},
        {"name": "ref_one_micro_batch", "mesh": {"world_size": 1}, "steps": 1},
        {"name": "ref_samples", "mesh": {"world_size": 1}, "steps": 1, "mbs": 2, "as_samples": True},
        {"name": "ref_accumulate", "mesh": {"world_size": 1}, "steps": 3, "accumulate": True},
        {"name": "moe_ref", "model_dir": d["moe"], "mesh": {"world_size": 1}, "steps": 3, "mbs": 1, "compare_hf": True},
        {"name": "llama", "model_dir": d["llama"], "mesh": {"world_size": 1}, "steps": 1, "compare_hf": True},
        {"name": "qwen2", "model_dir": d["qwen2"], "mesh": {"world_size": 1}, "steps": 1, "compare_hf": True},
        {"name": "bf16", "mesh": {"world_size": 1}, "steps": 1, "mixed_precision": "bf16"},
        {"name": "linear", "mesh": {"world_size": 1}, "steps": 3, "scheduler": ["LinearWarmupScheduler", 2, 5]},
        {"name": "constant", "mesh": {"world_size": 1}, "steps": 3, "scheduler": ["ConstantScheduler", 2, 5]},
        {"name": "save_ok", "mesh": {"world_size": 1}, "steps": 1, "save": str(d["root"] / "ckpt")},
        # last: it kills the process part-way through overwriting the checkpoint above
        {"name": "crash", "mesh": {"world_size": 1}, "steps": 2, "save": str(d["root"] / "ckpt"),
         "crash_in_save": True},
    ]
    return _run(1, _spec(models, runs), tmp_path_factory.mktemp("single"), exit_code=23)[0]


@pytest.fixture(scope="module")
def two(models, tmp_path_factory):
    d, root = models, models["root"]
    moe_sp = {"ep_size": 2, "tp_size": 2, "etp_size": 1, "sequence_parallel": True}
    runs = [
        {"name": "tp2", "mesh": {"tp_size": 2}, "steps": 3, "mbs": 1, "export_untrained": str(root / "x_tp2"),
         "save": str(root / "trained_tp2"), "probe_logits": True},
        {"name": "tp2_sp", "mesh": {"tp_size": 2, "sequence_parallel": True}, "steps": 3, "mbs": 1},
        {"name": "pp2", "mesh": {"pp_size": 2}, "steps": 3, "mbs": 1, "export_untrained": str(root / "x_pp2"),
         "eval_first": True},
        {"name": "pp2_vpp2", "mesh": {"pp_size": 2, "vpp_size": 2}, "steps": 3, "mbs": 1},
        {"name": "dp2_distopt", "mesh": {"dp_size": 2}, "steps": 3, "mbs": 1, "dist_opt": True},
        {"name": "pp2_accumulate", "mesh": {"pp_size": 2}, "steps": 3, "mbs": 1, "accumulate": True},
        {"name": "ep2", "model_dir": d["moe"], "mesh": {"ep_size": 2}, "steps": 3, "mbs": 1,
         "export_untrained": str(root / "x_ep2")},
        {"name": "tp2_ep2", "model_dir": d["moe"], "mesh": moe_sp, "steps": 3, "mbs": 1},
        {"name": "cp2", "mesh": {"cp_size": 2}, "steps": 3, "mbs": 1},
        {"name": "pp2_moe", "model_dir": d["moe"], "mesh": {"pp_size": 2}, "steps": 3, "mbs": 1},
        {"name": "cp2_ep2", "model_dir": d["moe"], "mesh": {"cp_size": 2, "ep_size": 2}, "steps": 3, "mbs": 1},
        {"name": "qwen2_tp2", "model_dir": d["qwen2"], "mesh": {"tp_size": 2}, "steps": 0, "compare_hf": True},
        {"name": "llama_pp2", "model_dir": d["llama"], "mesh": {"pp_size": 2}, "steps": 1, "mbs": 2,
         "export_untrained": str(root / "x_llama_pp2")},
        {"name": "resume_straight", "mesh": {"tp_size": 2}, "steps": 6, "mixed_precision": "bf16",
         "save": str(root / "straight6")},
        {"name": "resume_first", "mesh": {"tp_size": 2}, "steps": 3, "mixed_precision": "bf16",
         "save": str(root / "first3")},
        {"name": "resume_straight_distopt", "mesh": {"dp_size": 2}, "steps": 6, "mixed_precision": "bf16",
         "dist_opt": True, "save": str(root / "straight6_distopt")},
        {"name": "resume_first_distopt", "mesh": {"dp_size": 2}, "steps": 3, "mixed_precision": "bf16",
         "dist_opt": True, "save": str(root / "first3_distopt")},
        {"name": "bad_mesh", "mesh": {"tp_size": 3}, "steps": 1, "expect_error": True},
        {"name": "bad_heads", "mesh": {"tp_size": 2}, "model_dir": d["llama"], "steps": 1, "expect_error": True,
         "hf_overrides": {"num_key_value_heads": 1}},
        {"name": "missing_config", "mesh": {"tp_size": 2}, "model_dir": str(root / "absent"), "steps": 1,
         "expect_error": True},
        {"name": "bad_labels", "mesh": {"tp_size": 2}, "steps": 1, "expect_error": True, "bad_labels": True},
        {"name": "after_errors", "mesh": {"tp_size": 2}, "steps": 1},
    ]
    return _run(2, _spec(models, runs), tmp_path_factory.mktemp("two"))


def _close(a, b, tol=TOL):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert abs(x - y) <= tol * max(1.0, abs(y)), (a, b)


# ---- single process: the facade equals transformers ---------------------------------------

@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["ref", "moe_ref", "llama", "qwen2"])
def test_loss_and_logits_equal_transformers(single, name):
    rec = single[name]
    assert rec["ok"], rec.get("traceback")
    assert abs(rec["losses"][0] - rec["hf_loss"]) <= 1e-5, (rec["losses"][0], rec["hf_loss"])
    assert rec["logits_max_diff"] <= 1e-4


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["ref_one_micro_batch", "ref_samples", "ref_accumulate"])
def test_micro_batching_and_sample_lists_do_not_change_the_loss(single, name):
    ref, rec = single["ref"], single[name]
    assert rec["ok"], rec.get("traceback")
    _close(rec["losses"], ref["losses"][:len(rec["losses"])])
    _close(rec["norms"], ref["norms"][:len(rec["norms"])])


@pytest.mark.multiprocess
def test_bf16_trains_close_to_fp32(single):
    rec = single["bf16"]
    assert rec["ok"], rec.get("traceback")
    assert abs(rec["losses"][0] - single["ref"]["losses"][0]) < 2e-2
    assert abs(rec["norms"][0] - single["ref"]["norms"][0]) < 5e-2 * single["ref"]["norms"][0]


@pytest.mark.multiprocess
def test_metrics_and_configs(single):
    rec = single["ref"]
    m = rec["metric"]
    assert set(m) >= {"loss", "grad_norm", "lr", "tokens_per_s", "step"}
    assert m["step"] == 3 and m["tokens_per_s"] > 0
    assert m["grad_norm"] == rec["norms"][-1]
    assert min(rec["norms"]) > 1.0   # clip_grad_and_step(1.0) reports the norm before clipping
    # cosine with 1 warmup step over 10 steps, lr 1e-3, after 3 scheduler steps
    assert abs(m["lr"] - 1e-3 * 0.5 * (1 + math.cos(math.pi * 2 / 9))) < 1e-12
    assert "tp=1" in rec["configs"] and "qwen3" in rec["configs"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name, expected", [
    # after each optimizer step: warmup 2 steps to 1e-3, then decay over steps 2..5
    ("linear", [0.5e-3, 1e-3, 1e-3 * (1 - 1 / 3)]),
    ("constant", [0.5e-3, 1e-3, 1e-3]),
    ("ref", [1e-3, 1e-3 * 0.5 * (1 + math.cos(math.pi / 9)), 1e-3 * 0.5 * (1 + math.cos(math.pi * 2 / 9))]),
])
def test_lr_schedules(single, name, expected):
    rec = single[name]
    assert rec["ok"], rec.get("traceback")
    _close(rec["lrs"], expected, tol=1e-12)


# ---- the equivalence matrix ---------------------------------------------------------------

@pytest.mark.multiprocess
@pytest.mark.parametrize("name, ref", [
    ("tp2", "ref"), ("tp2_sp", "ref"), ("pp2", "ref"), ("pp2_vpp2", "ref"), ("dp2_distopt", "ref"),
    ("ep2", "moe_ref"), ("tp2_ep2", "moe_ref"), ("cp2", "ref"), ("cp2_ep2", "moe_ref"),
    ("pp2_moe", "moe_ref"), ("pp2_accumulate", "ref"),
])
def test_layout_matches_single_process(two, single, name, ref):
    for rank, res in enumerate(two):
        rec = res[name]
        assert rec["ok"], f"rank {rank}: {rec.get('traceback')}"
        _close(rec["losses"], single[ref]["losses"])
        _close(rec["norms"], single[ref]["norms"])


@pytest.mark.multiprocess
def test_forward_only_under_pp2_gives_the_first_training_loss(two, single):
    for res in two:
        rec = res["pp2"]
        assert rec["ok"], rec.get("traceback")
        _close([rec["eval"]["loss"]], single["ref"]["losses"][:1])
        assert rec["eval_metric"]["loss"] == rec["eval"]["loss"] and "grad_norm" not in rec["eval_metric"]
        # evaluation left no gradients behind: training still matches the reference
        _close(rec["losses"], single["ref"]["losses"])


@pytest.mark.multiprocess
def test_qwen2_bias_under_tp2_matches_transformers(two):
    rec = two[0]["qwen2_tp2"]
    assert rec["ok"], rec.get("traceback")
    assert rec["logits_max_diff"] <= 1e-4


# ---- HF round trips -----------------------------------------------------------------------

def _hf_state(path):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model, {k: v for k, v in model.state_dict().items()}


@pytest.mark.multiprocess
@pytest.mark.parametrize("run, export, src", [
    ("tp2", "x_tp2", "qwen3"), ("pp2", "x_pp2", "qwen3"), ("ep2", "x_ep2", "moe"),
    ("llama_pp2", "x_llama_pp2", "llama"),
])
def test_save_then_transformers_load_gives_identical_weights(two, models, run, export, src):
    assert two[0][run]["ok"], two[0][run].get("traceback")
    _, original = _hf_state(models[src])
    _, saved = _hf_state(str(models["root"] / export))
    assert set(saved) == set(original)
    for k in original:
        assert torch.equal(saved[k], original[k]), k


@pytest.mark.multiprocess
def test_trained_checkpoint_logits_match_megatron(two, models):
    rec = two[0]["tp2"]
    assert rec["ok"], rec.get("traceback")
    path = str(models["root"] / "trained_tp2")
    model, _ = _hf_state(path)
    from tests.megatron_workers.worker import probe_ids
    with torch.no_grad():
        logits = model(input_ids=probe_ids({"vocab": VOCAB, "seq": SEQ})).logits
    assert (logits - torch.tensor(rec["probe_logits"])).abs().max() <= 1e-4
    state = json.load(open(os.path.join(path, "trainer_state.json")))
    assert state["cur_step"] == 3 and state["consumed_train_samples"] == 3 * BATCH
    assert not os.path.exists(path + ".tmp")


@pytest.mark.multiprocess
def test_crash_during_save_leaves_the_previous_checkpoint(single, models):
    assert single["save_ok"]["ok"] and "crash" not in single
    path = models["root"] / "ckpt"
    state = json.load(open(path / "trainer_state.json"))
    assert state["cur_step"] == 1                      # the complete, older checkpoint
    partial = path.parent / (path.name + ".tmp")
    assert partial.is_dir() and not (partial / "trainer_state.json").exists()
    from twinkle_megatron import checkpoint
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        checkpoint.load(None, str(partial))


# ---- resume in a fresh process ------------------------------------------------------------

@pytest.fixture(scope="module")
def resumed(two, models, tmp_path_factory):
    root = models["root"]
    runs = [{"name": "resume", "mesh": {"tp_size": 2}, "steps": 3, "mixed_precision": "bf16",
             "resume": str(root / "first3"), "save": str(root / "resumed6")},
            {"name": "resume_distopt", "mesh": {"dp_size": 2}, "steps": 3, "mixed_precision": "bf16",
             "dist_opt": True, "resume": str(root / "first3_distopt"), "save": str(root / "resumed6_distopt")}]
    return _run(2, _spec(models, runs), tmp_path_factory.mktemp("resume"))


def _weights(path):
    from safetensors.torch import load_file
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("suffix", ["", "_distopt"])
def test_resume_in_fresh_process_continues_exactly(two, resumed, models, suffix):
    """6 steps straight == 3 steps, save, a fresh process resumes, 3 more (bf16: fp32 main
    params and Adam state must come back exactly)."""
    root = models["root"]
    straight = two[0]["resume_straight" + suffix]
    assert straight["ok"] and two[0]["resume_first" + suffix]["ok"], straight.get("traceback")
    for rank in range(2):
        rec = resumed[rank]["resume" + suffix]
        assert rec["ok"], rec.get("traceback")
        assert rec["progress"] == {"consumed_train_samples": 3 * BATCH, "cur_step": 3}
        assert rec["losses"] == straight["losses"][3:]
        assert rec["norms"] == straight["norms"][3:]
    a, b = _weights(str(root / ("straight6" + suffix))), _weights(str(root / ("resumed6" + suffix)))
    assert set(a) == set(b) and a
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ---- bad inputs and failures ----------------------------------------------------------------

@pytest.mark.multiprocess
@pytest.mark.parametrize("name, message", [
    ("bad_mesh", "world_size=2 is not divisible by tp_size*pp_size*cp_size=3*1*1=3"),
    ("bad_heads", "num_key_value_heads=1 is not divisible by tp_size=2"),
    ("missing_config", "no config.json"),
    ("bad_labels", "input_ids has (4, 16): they must match"),
])
def test_bad_input_is_a_clear_error_on_every_rank(two, name, message):
    for rank, res in enumerate(two):
        rec = res[name]
        assert not rec["ok"] and message in rec["error"], (rank, rec)
    for res in two:   # the processes are still usable afterwards
        assert res["after_errors"]["ok"]


@pytest.mark.multiprocess
def test_killed_rank_does_not_hang_the_others(models, tmp_path):
    runs = [{"name": "kill", "mesh": {"tp_size": 2}, "steps": 3, "kill_rank": 1}]
    try:
        results, rcs, logs, elapsed = launch(2, _spec(models, runs), str(tmp_path), timeout=120)
    except LaunchTimeout as e:
        pytest.fail(f"a surviving rank hung after its peer died: {e}")
    assert rcs[1] == 17
    # rank 0 either raised inside the step (recorded) or died with the broken connection
    assert rcs[0] != 0 or (results[0] and not results[0]["kill"]["ok"]), logs[0][-2000:]


# ---- four ranks -----------------------------------------------------------------------------

@pytest.mark.multiprocess
@pytest.mark.parametrize("name, ref", [("tp2_pp2", "ref"), ("cp2_tp2_sp", "ref"),
                                       ("dp2_tp2_ep2_etp2", "moe_ref")])
def test_four_rank_layouts_match_single_process(four, single, name, ref):
    for rank in range(4):
        rec = four[rank][name]
        assert rec["ok"], f"rank {rank}: {rec.get('traceback')}"
        _close(rec["losses"], single[ref]["losses"])
        _close(rec["norms"], single[ref]["norms"])


@pytest.mark.multiprocess
def test_expert_tp_export_gives_identical_weights(four, models):
    assert four[0]["dp2_tp2_ep2_etp2"]["ok"]
    _, original = _hf_state(models["moe"])
    _, saved = _hf_state(str(models["root"] / "x_etp2"))
    assert set(saved) == set(original)
    for k in original:
        assert torch.equal(saved[k], original[k]), k


@pytest.fixture(scope="module")
def four(models, tmp_path_factory):
    runs = [{"name": "tp2_pp2", "mesh": {"tp_size": 2, "pp_size": 2}, "steps": 3, "mbs": 1},
            {"name": "cp2_tp2_sp", "mesh": {"cp_size": 2, "tp_size": 2, "sequence_parallel": True},
             "steps": 3, "mbs": 1},
            # experts split over expert-TP too (etp_size=2), data over DP
            {"name": "dp2_tp2_ep2_etp2", "model_dir": models["moe"],
             "mesh": {"tp_size": 2, "ep_size": 2, "etp_size": 2, "sequence_parallel": True}, "steps": 3, "mbs": 1,
             "export_untrained": str(models["root"] / "x_etp2")}]
    return _run(4, _spec(models, runs), tmp_path_factory.mktemp("four"), timeout=300)


# ---- the example and the Megatron quickstart page (docs/megatron.md) --------------------------

def _readme_section():
    """The Megatron quickstart page: its first bash block is the torchrun commands, its first python
    block the training loop."""
    text = open(os.path.join(ROOT, "docs", "megatron.md")).read()
    return text[text.index("## Train on two processes"):]


def test_readme_loop_is_the_example_loop():
    """Every statement of the quickstart page's loop appears in the example (whitespace-insensitive),
    so running the example (below) exercises it."""
    import re
    section = _readme_section()
    block = section.split("```python", 1)[1].split("```", 1)[0]
    example = open(os.path.join(ROOT, "examples", "train_megatron.py")).read()
    flat = " ".join(example.split())
    # a statement: a line plus the more-indented continuation lines under it
    statements, current = [], []
    for line in block.splitlines():
        if not line.strip():
            continue
        if current and (line.startswith(" " * (len(current[0]) - len(current[0].lstrip()) + 1))
                        and not re.match(r"\s*(model|metric|for|if|path)\b", line)):
            current.append(line)
        else:
            if current:
                statements.append(current)
            current = [line]
    statements.append(current)
    assert len(statements) >= 8
    for st in statements:
        text = " ".join(" ".join(st).split())
        assert text in flat, text


@pytest.mark.multiprocess
@pytest.mark.parametrize("command_index", [0, 1])
def test_readme_torchrun_commands_train(command_index, tmp_path):
    import shlex
    import sys
    from conftest import run_in_own_group
    from twinkle_megatron.parallel.launch import free_port
    bash = _readme_section().split("```bash", 1)[1].split("```", 1)[0]
    command = shlex.split([l for l in bash.splitlines() if l.strip()][command_index])
    assert command[:2] == ["torchrun", "--nproc_per_node"]
    argv = [sys.executable, "-m", "torch.distributed.run", "--master_port", str(free_port())] + command[1:] + [
        "--steps", "12", "--output-dir", str(tmp_path)]
    env = dict(os.environ, PYTHONPATH=ROOT, TORCHDYNAMO_DISABLE="1")
    rc, out = run_in_own_group(argv, cwd=ROOT, env=env, timeout=240, what="the quickstart page's torchrun example")
    assert rc == 0, out[-3000:]
    import re
    losses = [float(x) for x in re.findall(r"'loss': ([0-9.]+)", out)]
    assert len(losses) >= 3 and losses[-1] < losses[0] - 0.5, losses
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "last-checkpoint"))
    assert model.config.model_type == "qwen3"
    state = json.load(open(tmp_path / "last-checkpoint" / "trainer_state.json"))
    assert state["cur_step"] == 12 and state["consumed_train_samples"] == 12 * 8


def test_attention_mask_must_be_right_padding_and_position_ids_pack():
    """Checked before anything distributed runs, so a bare object stands in for the model."""
    from twinkle_megatron.training.batching import micro_batches, to_batch as _to_batch
    import types
    mesh = types.SimpleNamespace(cp_size=1, tp_size=1, sequence_parallel=False)
    cpu = torch.device("cpu")
    ids = torch.arange(8).reshape(2, 4)
    left = {"input_ids": ids, "labels": ids, "attention_mask": torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])}
    with pytest.raises(NotImplementedError, match="right padding"):
        micro_batches(mesh, cpu, _to_batch(left), None)
    right = {"input_ids": ids, "labels": ids, "attention_mask": torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])}
    (mb,), _, seq = micro_batches(mesh, cpu, _to_batch(right), None)
    # shifted labels: position t predicts t+1; padded positions and the last one are ignored
    assert mb.labels.tolist() == [[1, -100, -100, -100], [5, 6, 7, -100]] and seq == 4
    # position_ids restarting at 0 pack samples: one THD row per micro-batch with cu_seqlens
    packed = {"input_ids": ids, "labels": ids, "position_ids": torch.tensor([[0, 1, 0, 1], [0, 1, 2, 3]])}
    (mb,), mbs, seq = micro_batches(mesh, cpu, _to_batch(packed), None)
    assert mbs == 1 and seq == 8 and mb.input_ids.tolist() == [list(range(8))]
    assert mb.packed_seq_params.qkv_format == "thd"
    assert mb.packed_seq_params.cu_seqlens_q.tolist() == [0, 2, 4, 8]
    assert mb.packed_seq_params.max_seqlen_q == 4
    assert mb.labels.tolist() == [[1, 2, 3, -100, 5, 6, 7, -100]]
    with pytest.raises(ValueError, match="position_ids must start at 0"):
        micro_batches(mesh, cpu, _to_batch({"input_ids": ids, "labels": ids,
                                                      "position_ids": ids + 1}), None)
    # packed rows under context parallelism (the packed_cp layout) need the CP process group: they
    # are checked on two gloo ranks in tests/megatron/test_gdn_context_parallel.py


# ---- one GPU (skipped without CUDA; needs megatron-core importable there) ----------------------

@pytest.mark.multiprocess
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_single_gpu_matches_transformers_and_round_trips(models, tmp_path):
    root = models["root"]
    runs = [
        {"name": "gpu_fp32", "mesh": {"world_size": 1}, "steps": 3, "mbs": 1, "compare_hf": True,
         "export_untrained": str(root / "x_gpu")},
        {"name": "gpu_moe", "model_dir": models["moe"], "mesh": {"world_size": 1}, "steps": 1, "compare_hf": True},
        {"name": "gpu_bf16", "mesh": {"world_size": 1}, "steps": 3, "mbs": 1, "mixed_precision": "bf16"},
    ]
    rec = _run(1, _spec(models, runs), tmp_path)[0]
    for name in ("gpu_fp32", "gpu_moe", "gpu_bf16"):
        assert rec[name]["ok"], rec[name].get("traceback")
    for name in ("gpu_fp32", "gpu_moe"):
        assert abs(rec[name]["losses"][0] - rec[name]["hf_loss"]) <= 1e-4
        assert rec[name]["logits_max_diff"] <= 1e-3   # GPU vs CPU kernels, fp32
    assert abs(rec["gpu_bf16"]["losses"][0] - rec["gpu_fp32"]["losses"][0]) < 2e-2
    _, original = _hf_state(models["qwen3"])
    _, saved = _hf_state(str(root / "x_gpu"))
    for k in original:
        assert torch.equal(saved[k], original[k]), k
