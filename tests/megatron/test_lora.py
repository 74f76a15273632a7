"""LoRA on the Megatron facade, against peft on the transformers model.

In-process (one rank): logits, loss and adapter gradients of a random (init_lora_weights=False)
adapter equal those of the same adapter exported and loaded by peft onto transformers' model, for
Qwen3 (local and twinkle specs), Qwen3-MoE (attention and routed-expert targets), the Qwen3.5 hybrid (Gated DeltaNet,
gated attention and MLP targets) and Qwen3.5-MoE (shared and routed experts); the base stays frozen; the
optimizer holds only the adapter; gradient accumulation equals the concatenated batches; merged
weights load into transformers; bad input is a clear error.
Multi-process (2 ranks, gloo): TP2, TP2+SP, PP2, PP2+VPP2, DP2 + distributed optimizer, CP2, and
for Qwen3-MoE with routed-expert adapters EP2 and TP2+SP (expert-TP 2), match the single-process run
in losses, grad norms and the saved adapter; a second launch (fresh processes) resumes the
first's checkpoints, LoRA and full training, and continues exactly as an unbroken run.
"""
import json
import os
import warnings

import pytest
from conftest import ROOT, megatron_one_rank
import torch

pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tests.megatron_workers.protocol import launch  # noqa: E402
from tests.megatron_workers.lora_worker import make_batch, train  # noqa: E402

WORKER = os.path.join(ROOT, "tests", "megatron_workers", "lora_worker.py")
VOCAB, BATCH, SEQ = 128, 4, 24
RANDOM_LORA = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "init_lora_weights": False}
COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
              max_position_embeddings=64, head_dim=16, tie_word_embeddings=False)
HYBRID = {
    "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "layer_types": ["linear_attention", "full_attention"],
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                        "mrope_section": [1, 1, 0], "mrope_interleaved": True},
    "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_hf")

    def save(model, name):
        with torch.no_grad():   # move norms (zero-centred ones included) off their defaults
            for n, p in model.named_parameters():
                if "norm" in n or "dt_bias" in n:
                    p.normal_(0.0, 0.3)
        model.save_pretrained(str(root / name))
        return str(root / name)

    torch.manual_seed(0)
    out = {
        "qwen3": save(transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
            intermediate_size=128, num_hidden_layers=4, **COMMON)), "qwen3"),
        "moe": save(transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
            num_hidden_layers=2, norm_topk_prob=True, **COMMON)), "moe"),
        "root": root,
    }
    if hasattr(transformers, "Qwen3_5MoeForCausalLM"):
        out["hybrid"] = save(transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**HYBRID)), "hybrid")
        moe = dict({k: v for k, v in HYBRID.items() if k != "intermediate_size"}, num_experts=4,
                   num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)
        out["hybrid_moe"] = save(transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**moe)),
                                 "hybrid_moe")
    return out


@pytest.fixture(scope="module")
def one_rank():
    with megatron_one_rank() as tm:
        yield tm


SPEC = {"batch": BATCH, "seq": SEQ, "vocab": VOCAB, "mbs": 1, "lora": RANDOM_LORA}


def _model(tm, path, lora=RANDOM_LORA, twinkle=False, accumulation=1, dist_opt=False):
    from tests.megatron_workers.lora_worker import build
    return build({"model_dir": path, "lora": lora, "twinkle": twinkle, "accumulation": accumulation,
                  "dist_opt": dist_opt}, SPEC, tm.DeviceMesh.from_sizes(world_size=1))


def _load_peft(path, adapter_dir):
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = peft.PeftModel.from_pretrained(hf, adapter_dir, is_trainable=True)
    bad = [str(w.message) for w in caught if "missing" in str(w.message).lower()
           or "unexpected" in str(w.message).lower()]
    assert not bad, bad
    return pm


def _rel(a, b):
    """Relative error ||a - b|| / ||b|| (Frobenius)."""
    return float((a - b).double().norm() / max(float(b.double().norm()), 1e-30))


# routed experts, as peft targets transformers' fused expert parameters
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
CASES = [("qwen3", False, RANDOM_LORA), ("qwen3", True, RANDOM_LORA),
         ("qwen3", False, dict(RANDOM_LORA, target_modules=["q_proj", "v_proj", "down_proj"], use_rslora=True)),
         ("moe", False, RANDOM_LORA), ("moe", False, dict(RANDOM_LORA, target_parameters=EXPERTS)),
         ("moe", True, dict(RANDOM_LORA, target_modules=None, target_parameters=["down_proj"])),
         ("hybrid", False, RANDOM_LORA), ("hybrid", True, RANDOM_LORA),
         ("hybrid_moe", False, dict(RANDOM_LORA, target_parameters=EXPERTS))]


@pytest.mark.parametrize("name,twinkle,lora", CASES,
                         ids=["qwen3", "qwen3-twinkle", "qwen3-qvdown-rslora", "qwen3_moe",
                              "qwen3_moe-experts", "qwen3_moe-twinkle-down-only", "hybrid",
                              "hybrid-twinkle", "hybrid_moe-experts"])
def test_equals_peft_on_transformers(one_rank, models, tmp_path, name, twinkle, lora):
    from twinkle_megatron import lora as tlora
    from twinkle_megatron.training import step
    if name not in models:
        pytest.skip("transformers has no Qwen3.5 models")
    path = models[name]
    model = _model(one_rank, path, lora, twinkle)
    ids, labels = make_batch(0, BATCH, SEQ, VOCAB)
    logits = model.logits(ids)
    out = model.forward_backward(inputs={"input_ids": ids, "labels": labels}, micro_batch_size=2)
    step.finalize_grads(model.engine, model.train_state())
    adapter = model.adapters["default"]
    grads = tlora.full_weights(adapter, grads=True)
    adapter_dir = model.save("adapter", output_dir=str(tmp_path))
    model.zero_grad()
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        saved_cfg = json.load(f)
    assert sorted(saved_cfg["target_modules"] or []) == sorted(adapter.targets)
    assert sorted(saved_cfg["target_parameters"] or []) == sorted(adapter.parameters)
    assert bool(adapter.parameters) == bool(lora.get("target_parameters"))

    pm = _load_peft(path, adapter_dir)
    hf_logits = pm(input_ids=ids).logits
    base_logits = pm.get_base_model()(input_ids=ids).logits
    with pm.disable_adapter():
        base_logits = pm(input_ids=ids).logits
    # (1e-3: a down_proj-only expert adapter moves the logits by ~6e-3, 500x the tolerance below)
    assert float((hf_logits - base_logits).abs().max()) > 1e-3, "the adapter should change the model"
    assert float((logits - hf_logits.detach()).abs().max()) < 1e-5
    loss = pm(input_ids=ids, labels=labels).loss
    loss.backward()
    assert abs(out["loss"] - float(loss)) < 1e-5 * max(1.0, float(loss))
    # The hybrid's chunked delta rule differs from transformers' by ~1e-5 relative in fp32 before
    # any LoRA (its base-weight gradients do too), so its adapter gradients get that much room.
    tol = 3e-5 if name.startswith("hybrid") else 1e-5
    mine = tlora.peft_state_dict(grads, adapter.parameters)   # peft's names and (for experts) fused layout
    seen, worst = 0, 0.0
    for n, p in pm.named_parameters():
        if ".lora_A." in n or ".lora_B." in n:
            g = mine[n.replace(".default.", ".")]
            assert _rel(g, p.grad) < tol, (n, _rel(g, p.grad))
            seen += 1
            worst = max(worst, _rel(g, p.grad))
    print(f"[{name}: logits max diff {float((logits - hf_logits.detach()).abs().max()):.2e}, "
          f"loss diff {abs(out['loss'] - float(loss)):.2e}, adapter grads max rel {worst:.2e}]")
    assert seen == len(mine) == 2 * (len(adapter.targets) + len(adapter.parameters))


def test_qwen3_targets_and_layout_of_fused_projections(one_rank, models):
    """A config that targets only q_proj changes only the q rows of linear_qkv."""
    model = _model(one_rank, models["qwen3"], dict(RANDOM_LORA, target_modules=["q_proj"]))
    assert model.adapters["default"].targets == [f"model.layers.{i}.self_attn.q_proj" for i in range(4)]
    qkv = model.unwrapped_chunks()[0].decoder.layers[0].self_attention.linear_qkv
    x = torch.randn(5, 1, 64)
    delta = qkv.lora["default"].delta(x).reshape(5, 2, 4, 16)     # [S, groups, (2 q heads, k, v), head_dim]
    assert float(delta[:, :, :2].abs().max()) > 0 and float(delta[:, :, 2:].abs().max()) == 0.0
    assert len(list(qkv.lora["default"].parameters())) == 2
    # adapters are keyed by name, as peft keys lora_A[<name>]
    assert list(qkv.lora) == ["default"]
    assert sorted(n for n, _ in qkv.named_parameters() if n.startswith("lora.")) == [
        "lora.default.lora_A.q_proj", "lora.default.lora_B.q_proj"]


def test_frozen_base_optimizer_state_and_merge(one_rank, models, tmp_path):
    from twinkle_megatron import lora as tlora
    path = models["qwen3"]
    model = _model(one_rank, path)
    base = {n: p.detach().clone() for c in model.unwrapped_chunks() for n, p in c.named_parameters()
            if ".lora." not in n}
    train(model, SPEC, 2)
    after = {n: p for c in model.unwrapped_chunks() for n, p in c.named_parameters()}
    assert all(torch.equal(after[n], v) and not after[n].requires_grad for n, v in base.items())
    trainable = sum(p.numel() for p in after.values() if p.requires_grad)
    opt_params = [p for g in model.optimizer.param_groups for p in g["params"]]
    assert sum(p.numel() for p in opt_params) == trainable
    state = sum(t.numel() for s in model.optimizer.optimizer.state.values() for t in s.values()
                if torch.is_tensor(t) and t.dim() > 0)
    assert state == 2 * trainable                      # Adam's two moments, adapter only
    assert f"trainable params {trainable} / " in model.get_train_configs()

    full = tlora.full_weights(model.adapters["default"])
    merged_dir = model.save("merged", output_dir=str(tmp_path), merge_lora=True)
    adapter_dir = model.save("adapter", output_dir=str(tmp_path))
    from safetensors.torch import load_file
    merged = {}
    for f in os.listdir(merged_dir):
        if f.endswith(".safetensors"):
            merged.update(load_file(os.path.join(merged_dir, f)))
    orig = load_file(os.path.join(path, "model.safetensors"))
    name = "model.layers.1.self_attn.k_proj"
    a, b = full[name]
    expected = orig[name + ".weight"].double() + b.double() @ a.double() * 2.0   # alpha / r = 2
    assert float((merged[name + ".weight"].double() - expected).abs().max()) < 1e-6
    assert torch.equal(merged["model.norm.weight"], orig["model.norm.weight"])
    ids = make_batch(9, 2, SEQ, VOCAB)[0]
    hf_merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    pm = _load_peft(path, adapter_dir)
    with torch.no_grad():
        assert float((hf_merged(input_ids=ids).logits - pm(input_ids=ids).logits).abs().max()) < 1e-4


def test_gradient_accumulation_equals_concatenated_batches(one_rank, models):
    from twinkle_megatron import lora as tlora
    accum = _model(one_rank, models["qwen3"], accumulation=2)
    norms_seen = []
    losses_a, norms_a = train(accum, SPEC, 2, calls_per_step=2)
    assert accum.cur_step == 2
    full_a = tlora.full_weights(accum.adapters["default"])
    plain = _model(one_rank, models["qwen3"])
    losses_b, norms_b = train(plain, SPEC, 2)
    full_b = tlora.full_weights(plain.adapters["default"])
    assert norms_seen == []
    for x, y in zip(losses_a + norms_a, losses_b + norms_b):
        assert abs(x - y) < 1e-5 * max(1.0, abs(y))
    assert max(float((full_a[k][i] - full_b[k][i]).abs().max()) for k in full_a for i in (0, 1)) < 1e-6


def test_accumulating_calls_return_none(one_rank, models):
    model = _model(one_rank, models["qwen3"], accumulation=3)
    ids, labels = make_batch(0, 2, SEQ, VOCAB)
    norms = []
    for _ in range(3):
        model.forward_backward(inputs={"input_ids": ids, "labels": labels})
        norms.append(model.clip_grad_and_step(1.0))
    assert norms[:2] == [None, None] and norms[2] > 0 and model.cur_step == 1


@pytest.mark.parametrize("lora,words", [
    (dict(RANDOM_LORA, target_modules=["q_proj", "qq_proj"]), "'qq_proj' matches no module"),
    (dict(RANDOM_LORA, target_modules="nothing.*"), "matches no module"),
    (dict(RANDOM_LORA, target_modules=["lm_head"]), "LM head"),
    (dict(RANDOM_LORA, target_modules=["embed_tokens"]), "embeddings"),
    (dict(RANDOM_LORA, use_dora=True), "use_dora"),
    (dict(RANDOM_LORA, modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(RANDOM_LORA, bias="all"), "bias"),
    (dict(RANDOM_LORA, init_lora_weights="gaussian"), "init_lora_weights"),
    (dict(RANDOM_LORA, not_a_field=1), "not_a_field"),
])
def test_bad_configs_name_the_problem(one_rank, models, lora, words):
    model = one_rank.MegatronModel(models["qwen3"], mixed_precision="fp32")
    with pytest.raises(ValueError, match=words):
        model.add_adapter_to_model("default", lora)


def test_moe_router_and_expert_modules_are_refused(one_rank, models):
    model = one_rank.MegatronModel(models["moe"], mixed_precision="fp32")
    with pytest.raises(ValueError, match="router"):
        model.add_adapter_to_model("default", dict(RANDOM_LORA, target_modules=["gate"]))
    with pytest.raises(ValueError, match="routed experts through target_modules.*target_parameters"):
        model.add_adapter_to_model("default", dict(RANDOM_LORA, target_modules=["experts"]))
    with pytest.raises(ValueError, match="target_parameters entry 'mlp.experts.up_proj' matches no"):
        model.add_adapter_to_model("default", dict(RANDOM_LORA, target_parameters=["mlp.experts.up_proj"]))
    with pytest.raises(ValueError, match="lora_dropout=0.1 with target_parameters"):
        model.add_adapter_to_model("default", dict(RANDOM_LORA, target_parameters=EXPERTS, lora_dropout=0.1))
    dense = one_rank.MegatronModel(models["qwen3"], mixed_precision="fp32")
    with pytest.raises(ValueError, match="has no routed experts"):
        dense.add_adapter_to_model("default", dict(RANDOM_LORA, target_parameters=EXPERTS))
    model.add_adapter_to_model("default", RANDOM_LORA)       # all-linear: attention only here
    adapter = model.adapters["default"]
    assert all("self_attn" in t for t in adapter.targets) and adapter.parameters == []


def test_moe_expert_adapter_merges_and_reloads(one_rank, models, tmp_path):
    """merge_lora folds each expert's delta into its HF weights; the saved adapter reloads."""
    from twinkle_megatron import lora as tlora
    path, lora = models["moe"], dict(RANDOM_LORA, target_modules=["q_proj"], target_parameters=EXPERTS)
    model = _model(one_rank, path, lora)
    train(model, SPEC, 1)
    merged_dir = model.save("merged", output_dir=str(tmp_path), merge_lora=True)
    adapter_dir = model.save("adapter", output_dir=str(tmp_path))
    ids = make_batch(9, 2, SEQ, VOCAB)[0]
    hf_merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    pm = _load_peft(path, adapter_dir)
    with torch.no_grad():
        assert float((hf_merged(input_ids=ids).logits - pm(input_ids=ids).logits).abs().max()) < 1e-4
        assert float((model.logits(ids) - pm(input_ids=ids).logits).abs().max()) < 1e-5
    fresh = _model(one_rank, path, lora)
    fresh.load(adapter_dir, load_optimizer=False)
    a, b = tlora.full_weights(model.adapters["default"]), tlora.full_weights(fresh.adapters["default"])
    assert a.keys() == b.keys() and all(torch.equal(a[k][i], b[k][i]) for k in a for i in (0, 1))


def test_bad_calls_are_clear_errors(one_rank, models, tmp_path):
    model = one_rank.MegatronModel(models["qwen3"], mixed_precision="fp32")
    with pytest.raises(ValueError, match="merge_lora=True needs an adapter"):
        model.save("x", output_dir=str(tmp_path), merge_lora=True)
    with pytest.raises(ValueError, match="adapter_name='default': this model has no adapter"):
        model.save("x", output_dir=str(tmp_path), adapter_name="default")
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        model.add_adapter_to_model("default", RANDOM_LORA, gradient_accumulation_steps=0)
    model.add_adapter_to_model("default", RANDOM_LORA)
    with pytest.raises(ValueError, match="already has adapter 'default'"):
        model.add_adapter_to_model("default", RANDOM_LORA)
    with pytest.raises(ValueError, match="adapter_name='other': this model has adapter 'default'"):
        model.save("x", output_dir=str(tmp_path), adapter_name="other")
    model.set_optimizer("AdamW", lr=1e-3)
    saved = model.save("ok", output_dir=str(tmp_path), adapter_name="default", save_optimizer=True)
    with pytest.raises(ValueError, match="adapter_name='other'"):
        model.resume_from_checkpoint(saved, adapter_name="other")
    fresh = one_rank.MegatronModel(models["qwen3"], mixed_precision="fp32")
    fresh.set_optimizer("AdamW", lr=1e-3)
    with pytest.raises(RuntimeError, match="before set_optimizer"):
        fresh.add_adapter_to_model("default", RANDOM_LORA)
    with pytest.raises(ValueError, match="call add_adapter_to_model"):
        fresh.resume_from_checkpoint(saved)
    other_r = one_rank.MegatronModel(models["qwen3"], mixed_precision="fp32")
    other_r.add_adapter_to_model("default", dict(RANDOM_LORA, r=8))
    with pytest.raises(ValueError, match="r=4"):
        other_r.load(saved, load_optimizer=False)


# ---- multi-process layouts ---------------------------------------------------------------------

LAYOUTS = {"tp2": {"tp_size": 2}, "tp2_sp": {"tp_size": 2, "sequence_parallel": True},
           "pp2": {"pp_size": 2}, "pp2_vpp2": {"pp_size": 2, "vpp_size": 2},
           "dp2_distopt": {"dp_size": 2}, "cp2": {"cp_size": 2}}


MOE_LORA = dict(RANDOM_LORA, target_parameters=EXPERTS)   # attention + routed experts


@pytest.fixture(scope="module")
def two(models, tmp_path_factory):
    root = models["root"]
    runs = [{"name": n, "mesh": m, "steps": 3, "save": str(root / f"lay_{n}"), "dist_opt": n == "dp2_distopt"}
            for n, m in LAYOUTS.items()]
    runs += [
        {"name": "tp2_sp_twinkle", "mesh": LAYOUTS["tp2_sp"], "steps": 3, "twinkle": True,
         "save": str(root / "lay_tp2_sp_twinkle")},
        # experts: EP2 (each rank holds two experts' adapters), TP2+SP (expert-TP 2: fc1's B and
        # fc2's A sharded, the other factor's gradient summed over expert-TP)
        {"name": "ep2", "model_dir": models["moe"], "mesh": {"ep_size": 2}, "steps": 3, "lora": MOE_LORA,
         "twinkle": True, "save": str(root / "lay_ep2")},
        {"name": "moe_tp2", "model_dir": models["moe"], "mesh": LAYOUTS["tp2_sp"], "steps": 3, "lora": MOE_LORA,
         "save": str(root / "lay_moe_tp2")},
        # experts under PP (each stage holds its layers' expert adapters) and DP with the
        # distributed optimizer (the adapters' optimizer state sharded)
        {"name": "moe_pp2", "model_dir": models["moe"], "mesh": LAYOUTS["pp2"], "steps": 3, "lora": MOE_LORA,
         "save": str(root / "lay_moe_pp2")},
        {"name": "moe_dp2_distopt", "model_dir": models["moe"], "mesh": LAYOUTS["dp2_distopt"], "steps": 3,
         "lora": MOE_LORA, "dist_opt": True, "save": str(root / "lay_moe_dp2_distopt")},
        # the first halves of the resume runs (the second halves start in fresh processes)
        {"name": "straight6", "mesh": {"tp_size": 2}, "steps": 6, "save": str(root / "straight6")},
        {"name": "first3", "mesh": {"tp_size": 2}, "steps": 3, "save": str(root / "first3")},
        {"name": "full_straight6", "mesh": {"pp_size": 2}, "lora": None, "steps": 6,
         "save": str(root / "full_straight6")},
        {"name": "full_first3", "mesh": {"pp_size": 2}, "lora": None, "steps": 3, "save": str(root / "full_first3")},
    ]
    spec = dict(SPEC, model_dir=models["qwen3"], runs=runs)
    results, rcs, logs, elapsed = launch(2, spec, str(tmp_path_factory.mktemp("lora2")), timeout=400,
                                         script=WORKER)
    assert all(r is not None for r in results) and rcs == [0, 0], "\n".join(l[-3000:] for l in logs)
    print(f"[2 ranks, {len(runs)} LoRA runs: {elapsed:.1f}s]")
    return results[0]


@pytest.fixture(scope="module")
def resumed(two, models, tmp_path_factory):
    """A second launch (fresh processes) resuming the first launch's 3-step checkpoints."""
    root = models["root"]
    assert two["first3"]["ok"] and two["full_first3"]["ok"], (two["first3"], two["full_first3"])
    runs = [{"name": "resumed", "mesh": {"tp_size": 2}, "steps": 3, "resume": str(root / "first3"),
             "save": str(root / "resumed")},
            {"name": "full_resumed", "mesh": {"pp_size": 2}, "lora": None, "steps": 3,
             "resume": str(root / "full_first3"), "save": str(root / "full_resumed")}]
    spec = dict(SPEC, model_dir=models["qwen3"], runs=runs)
    results, rcs, logs, elapsed = launch(2, spec, str(tmp_path_factory.mktemp("lora2_resume")), timeout=300,
                                         script=WORKER)
    assert all(r is not None for r in results) and rcs == [0, 0], "\n".join(l[-3000:] for l in logs)
    print(f"[2 ranks, resumed in fresh processes: {elapsed:.1f}s]")
    return results[0]


@pytest.fixture(scope="module")
def single_refs(one_rank, models):
    from twinkle_megatron import lora as tlora
    out = {}
    for name, lora in (("qwen3", RANDOM_LORA), ("moe", MOE_LORA)):
        model = _model(one_rank, models[name], lora)
        losses, norms = train(model, SPEC, 3)
        adapter = model.adapters["default"]
        out[name] = (losses, norms, tlora.full_weights(adapter), adapter.parameters)
    return out


def _saved(path):
    from safetensors.torch import load_file
    return load_file(os.path.join(path, "adapter_model.safetensors"))


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(LAYOUTS) + ["tp2_sp_twinkle", "ep2", "moe_tp2", "moe_pp2", "moe_dp2_distopt"])
def test_layouts_match_single_process(two, single_refs, models, name):
    from twinkle_megatron import lora as tlora
    rec = two[name]
    assert rec["ok"], rec.get("traceback")
    losses, norms, full, parameters = single_refs["moe" if name == "ep2" or name.startswith("moe_") else "qwen3"]
    for x, y in zip(rec["losses"] + rec["norms"], losses + norms):
        assert abs(x - y) < 1e-5 * max(1.0, abs(y)), (name, rec, losses, norms)
    saved = _saved(str(models["root"] / f"lay_{name}"))
    ref = tlora.peft_state_dict(full, parameters)
    assert saved.keys() == ref.keys()
    worst = max(float((saved[k] - ref[k]).abs().max()) for k in ref)
    loss_diff = max(abs(x - y) for x, y in zip(rec["losses"] + rec["norms"], losses + norms))
    print(f"[{name}: losses / grad norms max diff {loss_diff:.2e}, saved adapter max diff {worst:.2e}]")
    assert worst < 1e-6 * max(1.0, max(float(v.abs().max()) for v in ref.values()))


def _safetensors(path):
    from safetensors.torch import load_file
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_resume_in_fresh_processes_continues_exactly(two, resumed, models, lora):
    """6 straight steps == 3 steps, a save, new processes resuming (optimizer, scheduler, RNG), 3 more."""
    pre = "" if lora else "full_"
    rec = resumed[pre + "resumed"]
    assert rec["ok"], rec.get("traceback")
    straight = two[pre + "straight6"]["losses"] + two[pre + "straight6"]["norms"]
    halves = (two[pre + "first3"]["losses"] + rec["losses"]) + (two[pre + "first3"]["norms"] + rec["norms"])
    assert max(abs(x - y) for x, y in zip(straight, halves)) < 1e-6, (straight, halves)
    a, b = _safetensors(str(models["root"] / (pre + "straight6"))), _safetensors(str(models["root"] / (pre + "resumed")))
    assert a.keys() == b.keys() and len(a) > 0
    worst = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    print(f"[resume ({'lora' if lora else 'full'}): losses / norms max diff "
          f"{max(abs(x - y) for x, y in zip(straight, halves)):.2e}, saved weights max diff {worst:.2e}]")
    assert worst < 1e-6
    state = json.load(open(models["root"] / (pre + "resumed") / "trainer_state.json"))
    assert state["cur_step"] == 6 and state.get("adapter_name") == ("default" if lora else None)


@pytest.mark.multiprocess
def test_train_job_with_lora_rank(tmp_path):
    """python -m twinkle_megatron.job --lora-rank: loss falls, the adapter loads through peft."""
    import re
    import sys
    from conftest import run_in_own_group
    argv = [sys.executable, "-m", "twinkle_megatron.job", "--lora-rank", "4", "--lora-targets",
            "q_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", "--steps", "16", "--seq-len", "32",
            "--batch-size", "8", "--log-every", "5", "--output-dir", str(tmp_path),
            "--sample-prompt", "12+3="]
    env = dict(os.environ, PYTHONPATH=ROOT, TORCHDYNAMO_DISABLE="1")
    # an in-process test may have left a one-rank rendezvous behind; the job must start its own ranks
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    rc, out = run_in_own_group(argv, cwd=ROOT, env=env, timeout=300, what="the LoRA training job")
    assert rc == 0, out[-3000:]
    losses = [float(x) for x in re.findall(r"step \d+/16 loss ([0-9.]+)", out)]
    assert len(losses) >= 3 and losses[-1] < losses[0] - 0.3, losses
    assert "sample (transformers + peft adapter, greedy): '12+3=' -> " in out
    assert "trainable params" in out
    cfg = json.load(open(tmp_path / "final" / "adapter_config.json"))
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8 and len(cfg["target_modules"]) == 4 * 6
    _load_peft(str(tmp_path / "base"), str(tmp_path / "final"))


def test_benchmark_lora_variants_and_optimizer_state(one_rank):
    """The benchmark's LoRA rows (benchmarks/harness/model_step.py): their models train only the
    adapter, and the optimizer-state bytes it reports are Adam's two fp32 moments of it."""
    from benchmarks.harness import model_step
    cfg = model_step.tiny_config("qwen3", True).to_dict()
    mesh = one_rank.DeviceMesh.from_sizes(world_size=1)
    ids = make_batch(0, 2, 32, 512)[0]
    state = {}
    for name, build in model_step.LORA_VARIANTS.items():
        model = build(cfg, mesh)
        model.forward_backward(inputs={"input_ids": ids, "labels": ids})
        model.clip_grad_and_step(1.0)
        trainable = sum(p.numel() for c in model.unwrapped_chunks() for p in c.parameters() if p.requires_grad)
        state[name] = model_step._optimizer_state_bytes(model)
        assert state[name] == 2 * 4 * trainable, name
    assert state["lora r=8 q,v"] < 0.05 * state["full"]
    assert state["lora r=8 all-linear"] < 0.08 * state["full"]
    assert "megatron-lora" in model_step.MODEL_STEPS
