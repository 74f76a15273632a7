"""Several named LoRA adapters on one MegatronModel, trained time-shared (one process, fp32).

Two adapters that differ in rank, alpha, rsLoRA, targets and dropout, trained in turns on one
model, equal each trained alone on its own model (fp32 and bf16; under DP2 with the distributed
optimizer, TP2+SP and PP2xVPP2 too, with the second adapter added after the first stepped); training one leaves the other's weights and
optimizer state bit-identical; ``adapter_name=None`` runs the bare base model; a removed adapter
is freed and comes back fresh; each adapter's PEFT directory loads in peft; bad names are clear
errors naming the argument.
"""
import gc
import weakref

import pytest
from conftest import megatron_one_rank
import torch

pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tests.megatron_workers.lora_worker import make_batch  # noqa: E402

VOCAB, BATCH, SEQ = 128, 4, 24
A = {"r": 8, "lora_alpha": 16, "target_modules": "all-linear", "init_lora_weights": False}
B = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "use_rslora": True,
     "lora_dropout": 0.1, "init_lora_weights": False}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("multi_lora_hf") / "qwen3"
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
        max_position_embeddings=64, head_dim=16, tie_word_embeddings=False, intermediate_size=128,
        num_hidden_layers=4))
    model.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def tm():
    with megatron_one_rank() as tm:
        yield tm


def _model(tm, path, adapters, precision="fp32"):
    model = tm.MegatronModel(path, device_mesh=tm.DeviceMesh.from_sizes(world_size=1), mixed_precision=precision)
    for name, lora in adapters.items():
        model.add_adapter_to_model(name, lora)
        model.set_optimizer("AdamW", lr=1e-3, adapter_name=name)
        model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=1, num_training_steps=10,
                               adapter_name=name)
    return model


def _batch(name, step):
    ids, labels = make_batch(step + (100 if name == "b" else 0), BATCH, SEQ, VOCAB)
    return {"input_ids": ids, "labels": labels}


def _rel(x, y):
    return float((torch.as_tensor(x).double() - torch.as_tensor(y).double()).norm()
                 / max(float(torch.as_tensor(y).double().norm()), 1e-30))


def _weights(model, name):
    from twinkle_megatron import lora as tlora
    return tlora.full_weights(model.adapters[name])


def _optimizer_state(model, name):
    opt = model._states[name].optimizer
    return [t.clone() for s in opt.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_time_shared_equals_each_alone(tm, qwen3, precision):
    """a and b stepped in turns on one model: losses, grad norms and final weights as if alone
    (bf16: bf16 weights, fp32 main params in each adapter's own optimizer)."""
    shared = _model(tm, qwen3, {"a": A, "b": B}, precision)
    got = {"a": [], "b": []}
    for step in range(3):
        for name in ("a", "b"):
            got[name].append(shared.forward_backward(inputs=_batch(name, step), adapter_name=name)["loss"])
        norms = shared.clip_grad_and_step(1.0)      # every adapter holding grads, each its own step
        assert sorted(norms) == ["a", "b"]
        for name in ("a", "b"):
            got[name].append(norms[name])
    assert shared.clip_grad_and_step(1.0) == {}     # nothing accumulated since
    assert shared._states["a"].cur_step == shared._states["b"].cur_step == 3
    final = {n: _weights(shared, n) for n in ("a", "b")}
    for name, lora in (("a", A), ("b", B)):
        alone = _model(tm, qwen3, {name: lora}, precision)
        ref = []
        for step in range(3):
            ref.append(alone.forward_backward(inputs=_batch(name, step))["loss"])
            ref.append(alone.clip_grad_and_step(1.0))
        worst = max(_rel(x, y) for x, y in zip(got[name], ref))
        mine, theirs = final[name], _weights(alone, name)
        assert mine.keys() == theirs.keys()
        w = max(_rel(mine[k][i], theirs[k][i]) for k in mine for i in (0, 1))
        print(f"[{precision} {name}: losses / grad norms max rel {worst:.1e}, weights max rel {w:.1e}]")
        assert worst < 1e-6 and w < 1e-6, (name, got[name], ref)


def test_isolation_base_and_remove(tm, qwen3):
    shared = _model(tm, qwen3, {"a": A})
    for step in range(2):
        shared.forward_backward(inputs=_batch("a", step))
        shared.clip_grad_and_step(1.0)
    # b added after a has stepped (and after a's DDP wrap and optimizer exist)
    shared.add_adapter_to_model("b", B)
    shared.set_optimizer("AdamW", lr=1e-3, adapter_name="b")
    shared.forward_backward(inputs=_batch("b", 0), adapter_name="b")
    shared.clip_grad_and_step(1.0, adapter_name="b")
    b_weights, b_state = _weights(shared, "b"), _optimizer_state(shared, "b")
    a_before = _weights(shared, "a")
    for step in range(2, 4):
        shared.forward_backward(inputs=_batch("a", step), adapter_name="a")
        assert isinstance(shared.clip_grad_and_step(1.0, adapter_name="a"), float)
    a_after = _weights(shared, "a")
    assert any(not torch.equal(a_before[k][i], a_after[k][i]) for k in a_before for i in (0, 1))
    b_now, b_state_now = _weights(shared, "b"), _optimizer_state(shared, "b")
    assert all(torch.equal(b_weights[k][i], b_now[k][i]) for k in b_weights for i in (0, 1))
    assert len(b_state) == len(b_state_now) > 0 and all(torch.equal(x, y) for x, y in zip(b_state, b_state_now))
    assert shared._states["b"].cur_step == 1 and shared._states["a"].cur_step == 4

    # adapter_name=None: the base model, as a model without adapters computes it
    plain = tm.MegatronModel(qwen3, device_mesh=tm.DeviceMesh.from_sizes(world_size=1), mixed_precision="fp32")
    batch = _batch("a", 9)
    base = shared.forward_only(inputs=batch, adapter_name=None)["logps"]
    assert torch.equal(base, plain.forward_only(inputs=batch)["logps"])
    assert torch.equal(shared.logits(batch["input_ids"], adapter_name=None), plain.logits(batch["input_ids"]))
    assert not torch.equal(base, shared.forward_only(inputs=batch, adapter_name="a")["logps"])

    # remove_adapter frees a's parameters and optimizer; the name comes back fresh
    param = weakref.ref(next(iter(shared.adapters["a"].modules[0].parameters())))
    opt = weakref.ref(shared._states["a"].optimizer)
    shared.remove_adapter("a")
    gc.collect()
    assert param() is None and opt() is None
    assert list(shared.adapters) == ["b"]
    assert not any(".lora.a." in n for c in shared.unwrapped_chunks() for n, _ in c.named_parameters())
    shared.add_adapter_to_model("a", A)
    fresh = _model(tm, qwen3, {"a": A})
    again, init = _weights(shared, "a"), _weights(fresh, "a")
    assert all(torch.equal(again[k][i], init[k][i]) for k in init for i in (0, 1))
    assert shared._states["a"].cur_step == 0 and shared._states["a"].optimizer is None
    with pytest.raises(RuntimeError, match="adapter_name='a' has no optimizer"):
        shared.forward_backward(inputs=_batch("a", 0), adapter_name="a")
        shared.clip_grad_and_step(1.0, adapter_name="a")
    # b is untouched by all of it
    b_now = _weights(shared, "b")
    assert all(torch.equal(b_weights[k][i], b_now[k][i]) for k in b_weights for i in (0, 1))


def test_each_adapter_loads_in_peft(tm, qwen3, tmp_path):
    shared = _model(tm, qwen3, {"a": A, "b": B})
    for name in ("a", "b"):
        shared.forward_backward(inputs=_batch(name, 0), adapter_name=name)
    shared.clip_grad_and_step(1.0)
    ids = make_batch(7, 2, SEQ, VOCAB)[0]
    for name in ("a", "b"):
        path = shared.save(f"adapter_{name}", output_dir=str(tmp_path), adapter_name=name)
        hf = transformers.AutoModelForCausalLM.from_pretrained(qwen3, dtype=torch.float32)
        pm = peft.PeftModel.from_pretrained(hf, path)
        pm.eval()
        with torch.no_grad():
            theirs = pm(input_ids=ids).logits
        mine = shared.logits(ids, adapter_name=name)
        diff = float((mine - theirs).abs().max())
        print(f"[{name}: logits max diff vs peft {diff:.1e}]")
        assert diff < 1e-5
    with pytest.raises(ValueError, match="adapter_name is required"):
        shared.save("x", output_dir=str(tmp_path))


def test_each_adapter_resumes_its_own_state(tm, qwen3, tmp_path):
    """Both adapters saved with their optimizers, resumed into a fresh model, continue exactly."""
    def steps(model, start, n):
        out = []
        for step in range(start, start + n):
            for name in ("a", "b"):
                out.append(model.forward_backward(inputs=_batch(name, step), adapter_name=name)["loss"])
            norms = model.clip_grad_and_step(1.0)
            out += [norms["a"], norms["b"]]
        return out
    first = _model(tm, qwen3, {"a": A, "b": B})
    steps(first, 0, 2)
    paths = {n: first.save(f"ckpt_{n}", output_dir=str(tmp_path), adapter_name=n, save_optimizer=True)
             for n in ("a", "b")}
    straight = steps(first, 2, 2)
    resumed = _model(tm, qwen3, {"a": A, "b": B})
    with pytest.raises(ValueError, match="adapter_name='b'.*holds adapter 'a'"):
        resumed.resume_from_checkpoint(paths["a"], adapter_name="b")
    for n in ("a", "b"):
        assert resumed.resume_from_checkpoint(paths[n], adapter_name=n)["cur_step"] == 2
    assert resumed._states["a"].cur_step == resumed._states["b"].cur_step == 2
    again = steps(resumed, 2, 2)
    worst = max(_rel(x, y) for x, y in zip(again, straight))
    print(f"[resumed a and b: losses / grad norms max rel {worst:.1e}]")
    assert worst < 1e-6, (again, straight)


def test_each_adapter_keeps_its_own_settings(tm, qwen3):
    """Accumulation, loss, metrics, step counts and the train-config report are per adapter."""
    model = _model(tm, qwen3, {"b": B})
    model.add_adapter_to_model("a", A, gradient_accumulation_steps=2)
    model.set_optimizer("AdamW", lr=1e-3, adapter_name="a")
    model.set_loss("grpo", adapter_name="b")
    model.add_metric("mean_logp", lambda x: ((x.logps * x.loss_mask).sum(), x.loss_mask.sum()), adapter_name="a")
    assert type(model._states["b"].loss).__name__ == "GRPOLoss"
    assert type(model._states["a"].loss).__name__ == "CrossEntropyLoss"
    seen = []
    for step in range(2):
        out = model.forward_backward(inputs=_batch("a", step), adapter_name="a")
        assert "mean_logp" in out
        out = model.forward_backward(inputs=_batch("b", step), adapter_name="b", advantages=torch.ones(BATCH))
        assert "mean_logp" not in out
        seen.append(model.clip_grad_and_step(1.0))
    assert seen[0]["a"] is None and isinstance(seen[0]["b"], float)
    assert isinstance(seen[1]["a"], float) and isinstance(seen[1]["b"], float)
    assert model._states["a"].cur_step == 1 and model._states["b"].cur_step == 2
    assert model.calculate_metric(adapter_name="a")["step"] == 1
    assert model.calculate_metric(adapter_name="b")["step"] == 2
    both, only_b = model.get_train_configs(), model.get_train_configs(adapter_name="b")
    assert "adapter 'a': LoRA r=8" in both and "adapter 'b': LoRA r=4" in both
    assert "adapter 'b'" in only_b and "adapter 'a'" not in only_b and "accumulation=1" in only_b


def test_bad_names_are_clear_errors(tm, qwen3):
    model = _model(tm, qwen3, {"a": A})
    model.add_adapter_to_model("b", B)
    batch = _batch("a", 0)
    with pytest.raises(ValueError, match="adapter_name='zz': this model has adapter 'a', adapter 'b'"):
        model.forward_backward(inputs=batch, adapter_name="zz")
    with pytest.raises(ValueError, match="adapter_name is required"):
        model.forward_backward(inputs=batch)
    with pytest.raises(ValueError, match="adapter_name is required"):
        model.forward_only(inputs=batch)
    with pytest.raises(ValueError, match="adapter_name='zz'"):
        model.set_optimizer("AdamW", lr=1e-3, adapter_name="zz")
    with pytest.raises(ValueError, match="adapter_name='zz'"):
        model.remove_adapter("zz")
    with pytest.raises(RuntimeError, match="adapter_name='b' has no optimizer"):
        model.set_lr_scheduler("constant", adapter_name="b")
    model.forward_backward(inputs=batch, adapter_name="b")
    with pytest.raises(RuntimeError, match="adapter_name='b' has no optimizer"):
        model.clip_grad_and_step(1.0)
    with pytest.raises(RuntimeError, match="adapter_name='b' has no optimizer"):
        model.clip_grad_and_step(1.0, adapter_name="b")
    with pytest.raises(NotImplementedError, match="adapter_names= .* not supported yet"):
        model.forward_backward(inputs=batch, adapter_names=["a", "b", "a", "b"])
    with pytest.raises(ValueError, match="already has adapter 'a'"):
        model.add_adapter_to_model("a", A)


# ---- two processes (gloo): b added after a stepped and after a's DDP wrap ----------------------

MP_B = dict(B, lora_dropout=0.0)    # dropout masks differ with the layout
MP_LAYOUTS = {"dp2_distopt": {"mesh": {"dp_size": 2}, "dist_opt": True},
              "tp2_sp": {"mesh": {"tp_size": 2, "sequence_parallel": True}},
              "pp2_vpp2": {"mesh": {"pp_size": 2, "vpp_size": 2}}}


@pytest.fixture(scope="module")
def two_ranks(qwen3, tmp_path_factory):
    import os
    from tests.megatron_workers.protocol import launch
    save_dir = str(tmp_path_factory.mktemp("multi_lora_saved"))
    runs = [dict(cfg, name=n) for n, cfg in MP_LAYOUTS.items()]
    spec = {"model_dir": qwen3, "batch": BATCH, "seq": SEQ, "vocab": VOCAB, "a": A, "b": MP_B, "mbs": 1,
            "save_dir": save_dir, "runs": runs}
    script = os.path.join(os.path.dirname(__file__), "megatron_workers", "multi_lora_worker.py")
    results, rcs, logs, elapsed = launch(2, spec, str(tmp_path_factory.mktemp("multi_lora2")), timeout=400,
                                         script=script)
    assert all(r is not None for r in results) and rcs == [0, 0], "\n".join(l[-3000:] for l in logs)
    print(f"[2 ranks, {len(runs)} multi-adapter runs: {elapsed:.1f}s]")
    return results[0], save_dir


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", list(MP_LAYOUTS))
def test_adapter_added_after_wrap_trains_under_two_ranks(tm, qwen3, two_ranks, layout):
    """DP2 (distributed optimizer), TP2+SP and PP2 with virtual stages equal one process: b's
    grads are reduced over DP although its DDP wrap came after a's."""
    import os
    from safetensors.torch import load_file
    from twinkle_megatron import lora as tlora
    from tests.megatron_workers.multi_lora_worker import time_shared
    results, save_dir = two_ranks
    rec = results[layout]
    assert rec["ok"], rec.get("traceback")
    model = tm.MegatronModel(qwen3, device_mesh=tm.DeviceMesh.from_sizes(world_size=1), mixed_precision="fp32")
    ref = time_shared(model, {"batch": BATCH, "seq": SEQ, "vocab": VOCAB, "a": A, "b": MP_B, "mbs": 1})
    for name in ("a", "b"):
        worst = max(abs(x - y) / max(1.0, abs(y)) for x, y in zip(rec[name], ref[name]))
        saved = load_file(os.path.join(save_dir, f"{layout}_{name}", "adapter_model.safetensors"))
        full = tlora.peft_state_dict(_weights(model, name))
        assert saved.keys() == full.keys()
        w = max(_rel(saved[k], full[k]) for k in full)
        print(f"[{layout} {name}: losses / grad norms max diff {worst:.1e}, saved weights max rel {w:.1e}]")
        assert worst < 1e-5 and w < 1e-5, (layout, name, rec[name], ref[name])
