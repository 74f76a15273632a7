"""The Qwen3.5 hybrid (Gated DeltaNet + gated full attention) in megatron-core.

In-process (one rank): logits equal transformers' Qwen3_5ForCausalLM for the local and the
twinkle layer specs; the export gives back exactly the HF weights; the composite ``qwen3_5``
config (text under ``model.language_model.``) loads; packed samples (position_ids restarting at
0) equal the same samples run separately, in logits and in training loss and grads.
The MoE variant (Qwen3.5-MoE: experts + gated shared expert) likewise.
Multi-process (gloo, timeouts): TP2, TP2+SP, PP2, EP2 and TP2xEP2 conversion against transformers
and exact exports; the twinkle spec equals the local spec in loss, grads and grad norms under TP2,
TP2+SP, PP2, packed TP2+SP, bf16, and EP2 / TP2xEP2 for the MoE variant.
"""
import json
import os

import pytest
from conftest import ROOT, megatron_one_rank
import torch

pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5MoeForCausalLM"):
    pytest.skip(f"transformers {transformers.__version__} has no Qwen3.5 models", allow_module_level=True)

from tests.megatron_workers.protocol import launch  # noqa: E402

SPEC_WORKER = os.path.join(ROOT, "tests", "megatron_spec_worker.py")

# Tiny Qwen3.5 text config: 2 GDN + 2 gated-attention layers, grouped value heads (HV = 2H),
# partial rotary 0.5, interleaved M-RoPE (plain RoPE for text positions).
HYBRID = {
    "model_type": "qwen3_5_text", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                        "mrope_section": [1, 1, 0], "mrope_interleaved": True},
    "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
}


# The MoE variant (Qwen3.5-MoE): every layer's MLP is 4 experts top-2 plus a gated shared expert.
HYBRID_MOE = dict({k: v for k, v in HYBRID.items() if k != "intermediate_size"}, model_type="qwen3_5_moe_text",
                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                  shared_expert_intermediate_size=24)


def _hf_model(config=HYBRID, seed=0):
    torch.manual_seed(seed)
    moe = config["model_type"] == "qwen3_5_moe_text"
    cls_cfg, cls = ((transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM) if moe
                    else (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM))
    model = cls(cls_cfg(**{k: v for k, v in config.items() if k != "model_type"})).eval()
    with torch.no_grad():   # move the zero / one initialised norms, dt_bias, router off their defaults
        for name, p in model.named_parameters():
            if "norm" in name or "dt_bias" in name or name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.3)
    return model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen35")
    model = _hf_model()
    model.save_pretrained(str(path))
    return str(path), model


@pytest.fixture(scope="module")
def one_rank():
    with megatron_one_rank() as tm:
        yield tm


def test_model_shape_reads_qwen3_5_configs():
    from twinkle_megatron import config as hf_config
    s = hf_config.model_shape(HYBRID)
    assert s.hybrid and s.is_linear(0) and not s.is_linear(1)
    assert s.partial_rotary_factor == 0.5 and s.zero_centered_norm and s.attention_output_gate and s.qk_norm
    composite = hf_config.model_shape({"model_type": "qwen3_5", "text_config": dict(HYBRID)})
    assert composite.hf_prefix == "model.language_model." and composite.layer_types == s.layer_types
    # transformers' default pattern: every 4th layer is full attention
    dflt = hf_config.model_shape({k: v for k, v in HYBRID.items() if k != "layer_types"})
    assert dflt.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    with pytest.raises(ValueError, match="layer_types"):
        hf_config.model_shape(dict(HYBRID, layer_types=["linear_attention", "mamba"] * 2))
    with pytest.raises(ValueError, match="layer_types"):
        hf_config.model_shape(dict(HYBRID, layer_types=["full_attention"]))
    with pytest.raises(ValueError, match="text_config"):
        hf_config.model_shape({"model_type": "qwen3_5"})


@pytest.mark.parametrize("twinkle", [False, True], ids=["local", "twinkle"])
def test_logits_equal_transformers_and_export_is_exact(one_rank, hf_dir, twinkle):
    from twinkle_megatron import convert, spec as specs
    path, hf = hf_dir
    model = one_rank.MegatronModel(path, mixed_precision="fp32", use_twinkle_kernels=twinkle)
    kinds = specs.describe(model.unwrapped_chunks()[0]) or ""
    assert ("TwinkleGatedDeltaNet x2" in kinds) == twinkle, kinds
    ids = torch.randint(0, HYBRID["vocab_size"], (2, 45), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids).logits
    assert (model.logits(ids) - ref).abs().max() <= 1e-5
    dense, experts = convert.export_hf_state(model.unwrapped_chunks(), model.shape, torch.float32)
    original = hf.state_dict()
    assert not experts and set(dense) == set(original)
    for k in original:
        assert torch.equal(dense[k], original[k]), k


@pytest.mark.parametrize("twinkle", [False, True], ids=["local", "twinkle"])
def test_moe_variant_equals_transformers_and_round_trips(one_rank, tmp_path, twinkle):
    from twinkle_megatron import spec as specs
    hf = _hf_model(HYBRID_MOE, seed=2)
    hf.save_pretrained(str(tmp_path / "hf"))
    model = one_rank.MegatronModel(str(tmp_path / "hf"), mixed_precision="fp32", use_twinkle_kernels=twinkle)
    assert model.shape.num_experts == 4 and model.shape.shared_expert_intermediate_size == 24
    if twinkle:
        assert "TwinkleGroupedMLP x4" in specs.describe(model.unwrapped_chunks()[0])
    ids = torch.randint(0, HYBRID["vocab_size"], (2, 33), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        assert (model.logits(ids) - hf(ids).logits).abs().max() <= 1e-5
    model.save("export", output_dir=str(tmp_path))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"), dtype=torch.float32)
    original = hf.state_dict()
    assert set(back.state_dict()) == set(original)
    for k, v in back.state_dict().items():
        assert torch.equal(v, original[k]), k


def test_composite_qwen3_5_checkpoint_loads(one_rank, hf_dir, tmp_path):
    """A ``qwen3_5`` (vision + text) checkpoint: config under text_config, weights under
    model.language_model.*; the decoder built from it equals the text model."""
    from safetensors.torch import save_file
    path, hf = hf_dir
    state = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v.contiguous()
             for k, v in hf.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"model_type": "qwen3_5", "text_config": HYBRID, "tie_word_embeddings": False}, f)
    ids = torch.randint(0, HYBRID["vocab_size"], (1, 20), generator=torch.Generator().manual_seed(4))
    model = one_rank.MegatronModel(str(tmp_path), mixed_precision="fp32")
    with torch.no_grad():
        assert (model.logits(ids) - hf(ids).logits).abs().max() <= 1e-5


def _grads(model):
    return {n: p.main_grad.detach().clone() if getattr(p, "main_grad", None) is not None else p.grad.clone()
            for n, p in model.model[0].named_parameters()}


@pytest.mark.parametrize("twinkle", [False, True], ids=["local", "twinkle"])
def test_packed_samples_equal_separate_samples(one_rank, hf_dir, twinkle, monkeypatch):
    from twinkle_megatron.layers import attention as specs
    calls = {"rotate_thd": 0, "sdpa_thd": 0}
    for name in calls:   # count the twinkle spec's packed (THD) rotary and attention
        real = getattr(specs, name)
        monkeypatch.setattr(specs, name, lambda *a, _real=real, _name=name, **k: (
            calls.__setitem__(_name, calls[_name] + 1), _real(*a, **k))[1])
    path, _ = hf_dir
    lengths = [7, 70, 1, 26]     # 70 > the 64-token GDN chunk; a one-token sample
    g = torch.Generator().manual_seed(5)
    samples = [torch.randint(0, HYBRID["vocab_size"], (n,), generator=g) for n in lengths]
    model = one_rank.MegatronModel(path, mixed_precision="fp32", use_twinkle_kernels=twinkle)
    ids = torch.cat(samples)[None]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    packed = model.logits(ids, pos)
    separate = torch.cat([model.logits(x[None]) for x in samples], 1)
    assert (packed - separate).abs().max() <= 1e-5

    # Training: the packed row and the same samples as a padded batch give one loss and one grad.
    model.set_optimizer("AdamW", lr=1e-3)
    out_packed = model.forward_backward(inputs={"input_ids": ids, "labels": ids.clone(), "position_ids": pos})
    # the packed row's last token of each sample would predict the next sample's first: ignored
    # in the separate batch, so drop it here by masking each sample's first label
    assert out_packed["num_tokens"] == sum(lengths) - 1
    g_packed = _grads(model)
    model.zero_grad()
    labels = ids.clone()
    starts = torch.cumsum(torch.tensor([0] + lengths[:-1]), 0)
    labels[0, starts] = -100
    out_masked = model.forward_backward(inputs={"input_ids": ids, "labels": labels, "position_ids": pos})
    g_masked = _grads(model)
    model.zero_grad()
    out_sep = model.forward_backward(inputs=[{"input_ids": x.tolist(), "labels": x.tolist()} for x in samples])
    g_sep = _grads(model)
    model.zero_grad()
    assert out_masked["num_tokens"] == out_sep["num_tokens"] == sum(n - 1 for n in lengths)
    assert abs(out_masked["loss"] - out_sep["loss"]) <= 1e-5
    assert abs(out_packed["loss"] - out_masked["loss"]) > 1e-4   # the boundary tokens counted
    for k in g_sep:
        torch.testing.assert_close(g_masked[k], g_sep[k], rtol=1e-4, atol=1e-6, msg=lambda m: f"{k}: {m}")
    assert any(not torch.allclose(g_packed[k], g_masked[k]) for k in g_sep)
    # the twinkle spec ran the packed rotary and attention itself (2 attention layers per forward)
    assert (min(calls.values()) > 0) == twinkle, calls


# ---- multi-process ---------------------------------------------------------------------------

@pytest.mark.multiprocess
def test_tp2_sp_pp2_ep2_conversion_matches_transformers(tmp_path):
    path, moe = tmp_path / "hf", tmp_path / "hf_moe"
    _hf_model(seed=1).save_pretrained(str(path))
    _hf_model(HYBRID_MOE, seed=3).save_pretrained(str(moe))
    moe_sp = {"tp_size": 2, "ep_size": 2, "etp_size": 1, "sequence_parallel": True}
    spec = {"model_dir": str(path), "batch": 4, "seq": 24, "vocab": HYBRID["vocab_size"], "runs": [
        {"name": "moe_ep2", "model_dir": str(moe), "mesh": {"ep_size": 2}, "steps": 1, "compare_hf": True,
         "export_untrained": str(tmp_path / "x_moe_ep2")},
        {"name": "moe_tp2_ep2", "model_dir": str(moe), "mesh": moe_sp, "steps": 1, "compare_hf": True},
        {"name": "tp2", "mesh": {"tp_size": 2}, "steps": 1, "compare_hf": True,
         "export_untrained": str(tmp_path / "x_tp2")},
        {"name": "tp2_sp", "mesh": {"tp_size": 2, "sequence_parallel": True}, "steps": 1, "compare_hf": True},
        {"name": "pp2", "mesh": {"pp_size": 2}, "steps": 1, "export_untrained": str(tmp_path / "x_pp2")},
    ]}
    results, codes, logs, _ = launch(2, spec, str(tmp_path / "run"), timeout=200)
    assert codes == [0, 0], "\n".join(t[-3000:] for t in logs)
    r0 = results[0]
    for name in ("tp2", "tp2_sp", "moe_ep2", "moe_tp2_ep2"):
        assert r0[name]["ok"] and r0[name]["logits_max_diff"] <= 1e-5, r0[name]
        assert abs(r0[name]["losses"][0] - r0[name]["hf_loss"]) <= 1e-5, r0[name]
    assert abs(r0["pp2"]["losses"][0] - r0["tp2"]["hf_loss"]) <= 1e-5, r0["pp2"]
    original = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).state_dict()
    original_moe = transformers.AutoModelForCausalLM.from_pretrained(str(moe), dtype=torch.float32).state_dict()
    for export, source in (("x_tp2", original), ("x_pp2", original), ("x_moe_ep2", original_moe)):
        saved = transformers.AutoModelForCausalLM.from_pretrained(
            str(tmp_path / export), dtype=torch.float32).state_dict()
        assert set(saved) == set(source)
        for k in source:
            assert torch.equal(saved[k], source[k]), (export, k)


@pytest.mark.multiprocess
def test_twinkle_spec_equals_local_spec_tp2_sp_pp2_packed_moe(tmp_path):
    from tests.megatron.test_megatron_specs import _check
    layouts = [("tp2", {"tp_size": 2}), ("tp2sp", {"tp_size": 2, "sequence_parallel": True}),
               ("pp2", {"pp_size": 2})]
    runs = [{"name": n, "mesh": m, "config": HYBRID, "precision": "fp32"} for n, m in layouts]
    runs += [{"name": "tp2packed", "mesh": {"tp_size": 2, "sequence_parallel": True}, "config": HYBRID,
              "precision": "fp32", "packed": True},
             {"name": "tp2bf16", "mesh": {"tp_size": 2}, "config": HYBRID, "precision": "bf16"},
             {"name": "moe_ep2", "mesh": {"ep_size": 2}, "config": HYBRID_MOE, "precision": "fp32"},
             {"name": "moe_tp2ep2", "mesh": {"tp_size": 2, "ep_size": 2, "etp_size": 1, "sequence_parallel": True},
              "config": HYBRID_MOE, "precision": "fp32"}]
    results, codes, logs, _ = launch(2, {"runs": runs}, str(tmp_path), timeout=200, script=SPEC_WORKER)
    assert codes == [0, 0], "\n".join(t[-3000:] for t in logs)
    # grads relative to each tensor's largest, floored at 1e-3 of the model's largest grad (the
    # decay parameters' grads are ~1e-5 with fp32 summation noise ~1e-8)
    _check(results, ["tp2", "tp2sp", "pp2", "tp2packed", "moe_ep2", "moe_tp2ep2"], loss_tol=1e-5,
           grad_tol=1e-4, grad_key="grad_rel_floored")
    _check(results, ["tp2bf16"], loss_tol=2e-2, grad_tol=1e-1, grad_key="grad_rel_floored")
    for name in ("tp2", "tp2packed"):
        kinds = results[0][name]["kinds"]
        assert "TwinkleGatedDeltaNet x2" in kinds and "TwinkleSelfAttention x2" in kinds, kinds


def test_cosine_schedule_ends_at_min_lr(one_rank, hf_dir):
    """(Facade, checked here because this file has an in-process rank.) megatron's param groups
    carry their own min_lr; set_lr_scheduler(min_lr=...) must win over it."""
    model = one_rank.MegatronModel(hf_dir[0], mixed_precision="fp32")
    model.set_optimizer("AdamW", lr=1e-3)
    model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=1, num_training_steps=4, min_lr=1e-4)
    ids = torch.randint(0, HYBRID["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(6))
    lrs = []
    for _ in range(6):
        model.forward_backward(inputs={"input_ids": ids, "labels": ids})
        model.clip_grad_and_step(1.0)
        lrs.append(model.current_lr())
    assert lrs[0] == pytest.approx(1e-3) and lrs[-1] == pytest.approx(1e-4) and min(lrs) >= 1e-4 - 1e-12, lrs


# ---- one GPU (skipped without CUDA; needs megatron-core importable there) ---------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_single_gpu_hybrid_matches_transformers_packed_and_trains(one_rank, hf_dir):
    """On CUDA the twinkle spec runs the GDN core on the Triton kernels: logits against
    transformers (on the CPU, fp32), packed == separate, and bf16 training steps stay finite."""
    path, hf = hf_dir
    model = one_rank.MegatronModel(path, mixed_precision="fp32", use_twinkle_kernels=True)
    assert model.device.type == "cuda"
    ids = torch.randint(0, HYBRID["vocab_size"], (2, 45), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids).logits
    assert (model.logits(ids) - ref).abs().max() <= 1e-4
    lengths = [7, 70, 1, 26]
    flat = torch.randint(0, HYBRID["vocab_size"], (1, sum(lengths)), generator=torch.Generator().manual_seed(5))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    separate = torch.cat([model.logits(x) for x in flat.split(lengths, 1)], 1)
    assert (model.logits(flat, pos) - separate).abs().max() <= 1e-4
    bf16 = one_rank.MegatronModel(path, mixed_precision="bf16", use_twinkle_kernels=True)
    bf16.set_optimizer("AdamW", lr=1e-3)
    losses = []
    for _ in range(3):
        out = bf16.forward_backward(inputs={"input_ids": flat, "labels": flat, "position_ids": pos})
        bf16.clip_grad_and_step(1.0)
        losses.append(out["loss"])
    assert all(x == x and x < 10 for x in losses) and losses[-1] < losses[0], losses
