"""Several named LoRA adapters on one MegatronModel, trained time-shared or mixed in one batch.

Two adapters that differ in rank, alpha, rsLoRA, targets and dropout, trained in turns on one
model, equal each trained alone on its own model (fp32 and bf16; under DP2 with the distributed
optimizer, TP2+SP and PP2xVPP2 too, with the second adapter added after the first stepped); training one leaves the other's weights and
optimizer state bit-identical; ``adapter_name=None`` runs the bare base model; a removed adapter
is freed and comes back fresh; each adapter's PEFT directory loads in peft; bad names are clear
errors naming the argument. Mixed batches (``adapter_names=``, one name per row) equal the same
rows sent per adapter (one process, plain and packed rows, twinkle_kernels on; DP2 with the
distributed optimizer, PP2xVPP2, CP2), also across accumulation calls, and on a MoE model with
adapters on routed experts (one process; TP2+SP with expert-TP2 and packed rows, EP2, TP2+SP x
EP2); the grouped LoRA
delta equals a loop of per-adapter LoRAs in float64 with gradients.
"""
import gc
import weakref

import pytest
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
    opt = model.engine.states[name].optimizer
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
    assert shared.engine.states["a"].cur_step == shared.engine.states["b"].cur_step == 3
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
    assert shared.engine.states["b"].cur_step == 1 and shared.engine.states["a"].cur_step == 4

    # adapter_name=None: the base model, as a model without adapters computes it
    plain = tm.MegatronModel(qwen3, device_mesh=tm.DeviceMesh.from_sizes(world_size=1), mixed_precision="fp32")
    batch = _batch("a", 9)
    base = shared.forward_only(inputs=batch, adapter_name=None)["logps"]
    assert torch.equal(base, plain.forward_only(inputs=batch)["logps"])
    assert torch.equal(shared.logits(batch["input_ids"], adapter_name=None), plain.logits(batch["input_ids"]))
    assert not torch.equal(base, shared.forward_only(inputs=batch, adapter_name="a")["logps"])

    # remove_adapter frees a's parameters and optimizer; the name comes back fresh
    param = weakref.ref(next(iter(shared.adapters["a"].modules[0].parameters())))
    opt = weakref.ref(shared.engine.states["a"].optimizer)
    shared.remove_adapter("a")
    gc.collect()
    assert param() is None and opt() is None
    assert list(shared.adapters) == ["b"]
    assert not any(".lora.a." in n for c in shared.unwrapped_chunks() for n, _ in c.named_parameters())
    shared.add_adapter_to_model("a", A)
    fresh = _model(tm, qwen3, {"a": A})
    again, init = _weights(shared, "a"), _weights(fresh, "a")
    assert all(torch.equal(again[k][i], init[k][i]) for k in init for i in (0, 1))
    assert shared.engine.states["a"].cur_step == 0 and shared.engine.states["a"].optimizer is None
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
    assert resumed.engine.states["a"].cur_step == resumed.engine.states["b"].cur_step == 2
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
    assert type(model.engine.states["b"].loss).__name__ == "GRPOLoss"
    assert type(model.engine.states["a"].loss).__name__ == "CrossEntropyLoss"
    seen = []
    for step in range(2):
        out = model.forward_backward(inputs=_batch("a", step), adapter_name="a")
        assert "mean_logp" in out
        out = model.forward_backward(inputs=_batch("b", step), adapter_name="b", advantages=torch.ones(BATCH))
        assert "mean_logp" not in out
        seen.append(model.clip_grad_and_step(1.0))
    assert seen[0]["a"] is None and isinstance(seen[0]["b"], float)
    assert isinstance(seen[1]["a"], float) and isinstance(seen[1]["b"], float)
    assert model.engine.states["a"].cur_step == 1 and model.engine.states["b"].cur_step == 2
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
    # mixed batches: adapter_names
    with pytest.raises(ValueError, match=r"adapter_names\[1\]='zz': this model has adapter 'a', adapter 'b'"):
        model.forward_backward(inputs=batch, adapter_names=["a", "zz", "a", "a"])
    with pytest.raises(ValueError, match="adapter_names has 3 names, the batch has 4 rows"):
        model.forward_backward(inputs=batch, adapter_names=["a", "a", "a"])
    with pytest.raises(ValueError, match=r"adapter_names\[3\]='b' has no optimizer: call set_optimizer"):
        model.forward_backward(inputs=batch, adapter_names=["a", "a", "a", "b"])
    with pytest.raises(TypeError, match="adapter_names must be a list"):
        model.forward_backward(inputs=batch, adapter_names="a")
    with pytest.raises(TypeError, match="adapter_name or adapter_names, not both"):
        model.forward_backward(inputs=batch, adapter_name="a", adapter_names=["a"] * 4)
    with pytest.raises(TypeError, match=r"no adapter in adapter_names has a loss that takes \['advantages'\]"):
        model.forward_backward(inputs=batch, adapter_names=["a"] * 4, advantages=torch.ones(4))
    with pytest.raises(ValueError, match="already has adapter 'a'"):
        model.add_adapter_to_model("a", A)
    # adapters on routed experts: what the index column cannot follow is named
    from types import SimpleNamespace
    from twinkle_megatron.lora.mixed_experts import check_config
    with pytest.raises(NotImplementedError, match="alltoall token dispatcher, not 'allgather'"):
        check_config(SimpleNamespace(moe_token_dispatcher_type="allgather"), 2, torch.float32)
    with pytest.raises(NotImplementedError, match="moe_apply_probs_on_input on"):
        check_config(SimpleNamespace(moe_apply_probs_on_input=True), 2, torch.float32)
    with pytest.raises(NotImplementedError, match="300 adapters .* bf16"):
        check_config(SimpleNamespace(), 300, torch.bfloat16)
    check_config(SimpleNamespace(), 300, torch.float32)


# ---- mixed batches: several adapters' rows in one pass ------------------------------------------

MIX_B = dict(B, lora_dropout=0.0)   # dropout masks depend on how rows are batched


def test_grouped_lora_delta_matches_per_adapter_loop():
    """The grouped delta (tokens permuted into adapter segments, two grouped matmuls, ranks padded
    to the largest) against one plain LoRA per adapter, float64 and fp32 against float64, with
    gradients; odd sizes, an empty segment, tokens of no adapter; fresh outputs NaN-poisoned."""
    from twinkle_kernels.testing import assert_close, poison_outputs
    from twinkle_megatron.lora import grouped
    g = torch.Generator().manual_seed(5)
    n, d_in, d_out, ranks = 37, 19, 23, (5, 2, 7, 1)
    groups = torch.randint(-1, len(ranks), (n,), generator=g)
    groups[groups == 2] = 3                      # adapter 2: no tokens (an empty segment)
    scalings = [0.5, 2.0, 1.25, 3.0]
    x64 = torch.randn(n, d_in, generator=g, dtype=torch.float64)
    fac64 = [(torch.randn(r, d_in, generator=g, dtype=torch.float64),
              torch.randn(d_out, r, generator=g, dtype=torch.float64)) for r in ranks]
    dy = torch.randn(n, d_out, generator=g, dtype=torch.float64)

    def run(fn, dtype):
        x = x64.to(dtype).clone().requires_grad_()
        fac = [(a.to(dtype).clone().requires_grad_(), b.to(dtype).clone().requires_grad_()) for a, b in fac64]
        y = fn(x, groups, fac, scalings)
        y.backward(dy.to(dtype))
        return [y.detach(), x.grad] + [p.grad for pair in fac for p in pair]

    ref = run(grouped.lora_delta_reference, torch.float64)
    assert float(ref[0][groups == -1].abs().max()) == 0.0
    assert float(ref[2 + 2 * 2].abs().max()) == 0.0 and float(ref[3 + 2 * 2].abs().max()) == 0.0
    with poison_outputs():
        for dtype in (torch.float64, torch.float32):
            got = run(grouped.lora_delta, dtype)
            names = ["y", "dx"] + [f"d{f}{i}" for i in range(len(ranks)) for f in "AB"]
            for name, mine, theirs in zip(names, got, ref):
                assert_close(mine, theirs, dtype, name=name, scale=n ** 0.5)
    # the two halves (a layer with TP communication between them), and the delta added to the
    # layer's own output (its gradient passes through unchanged)
    base64 = torch.randn(n, d_out, generator=g, dtype=torch.float64)

    def halves(x, groups, fac, scalings):
        f = grouped.Factors(lambda: fac, [p for pair in fac for p in pair], scalings)
        seg = grouped.sort_by_group(groups, len(fac))
        return grouped.grouped_factor(grouped.grouped_factor(x, seg, f, "a"), seg, f, "b")

    def onto_base(x, groups, fac, scalings):
        f = grouped.Factors(lambda: fac, [p for pair in fac for p in pair], scalings)
        base = base64.to(x.dtype).clone().requires_grad_()
        out = grouped.grouped_lora(x, grouped.sort_by_group(groups, len(fac)), f, base=base)
        bases.append(base)
        return out - base.detach()
    bases = []
    with poison_outputs():
        for fn in (halves, onto_base):
            got = run(fn, torch.float64)
            for name, mine, theirs in zip(["y", "dx"] + [f"d{i}" for i in range(2 * len(ranks))], got, ref):
                assert_close(mine, theirs, torch.float64, name=f"{fn.__name__} {name}", scale=n ** 0.5)
    assert torch.equal(bases[0].grad, dy)
    with pytest.raises(ValueError, match="which must be 'a' or 'b'"):
        grouped.grouped_factor(x64, grouped.sort_by_group(groups, 4), grouped.Factors(lambda: fac64, [], [1.0] * 4), "c")
    with pytest.raises(ValueError, match="groups must be an int"):
        grouped.sort_by_group(groups.float(), len(ranks))


def test_stacked_factors_equal_each_adapters_own(tm, qwen3):
    """The one-concatenation stacks of adapters sharing a layout equal each adapter's factors
    stacked apart, on every adapted linear (fused q/k/v and gate/up included); adapters whose
    layouts differ (other rank or targets) get None and are stacked apart."""
    from twinkle_megatron.lora import grouped, linear
    model = _model(tm, qwen3, {"a": A, "a2": dict(A, lora_alpha=4), "b": MIX_B})
    seen = 0
    for chunk in model.unwrapped_chunks():
        for base in chunk.modules():
            slots = base._modules.get("lora")
            if not isinstance(slots, torch.nn.ModuleDict):
                continue
            same = [slots["a"], slots["a2"]]
            stacked = linear.stacked_factors(same)
            pairs = [m.factors() for m in same]
            w_a, w_b = stacked()
            assert torch.equal(w_a, grouped.stack_a(pairs)) and torch.equal(w_b, grouped.stack_b(pairs))
            # its gradients of the parameters are autograd's through the stacking
            dw_a, dw_b = torch.randn_like(w_a), torch.randn_like(w_b)
            params = stacked.a_params + stacked.b_params
            want = torch.autograd.grad((w_a * dw_a).sum() + (w_b * dw_b).sum(), params)
            got = dict((id(p), g) for p, g in stacked.grads(dw_a, dw_b))
            assert len(got) == len(params) and all(torch.equal(got[id(p)], w) for p, w in zip(params, want))
            seen += 1
            if "b" in slots:
                assert linear.stacked_factors([slots["a"], slots["b"]]) is None
    assert seen == 4 * 4   # 4 layers x (linear_qkv, linear_proj, linear_fc1, linear_fc2)
    del model
    gc.collect()


def _mixed_vs_time_shared(tm, path, spec, **model_kwargs):
    from tests.megatron_workers.multi_lora_worker import mixed_or_time_shared
    got = {}
    for mixed in (True, False):
        model = tm.MegatronModel(path, device_mesh=tm.DeviceMesh.from_sizes(world_size=1), mixed_precision="fp32",
                                 **model_kwargs)
        rec = mixed_or_time_shared(model, spec, mixed)
        got[mixed] = (rec, {n: _weights(model, n) for n in ("a", "b")}, model)
    return got


@pytest.mark.parametrize("case", ["plain", "packed", "twinkle_kernels", "recompute"])
def test_mixed_equals_time_shared(tm, qwen3, case):
    """a (r=8, all-linear, cross entropy) and b (r=4, q_proj/v_proj, rsLoRA, GRPO with advantages):
    one mixed batch per step equals the same rows sent per adapter, over 3 steps (losses,
    per-adapter grad norms, final weights)."""
    spec = {"batch": BATCH, "seq": SEQ, "vocab": VOCAB, "a": A, "b": MIX_B, "packed": case == "packed"}
    extra = RECOMPUTE if case == "recompute" else {}
    got = _mixed_vs_time_shared(tm, qwen3, spec, use_twinkle_kernels=case == "twinkle_kernels", **extra)
    # packed: one THD row of twice the tokens, so every sum over tokens runs in another order
    bar = 5e-6 if case == "packed" else 1e-6
    for name in ("a", "b"):
        mine, ref = got[True][0][name], got[False][0][name]
        worst = max(_rel(x, y) for x, y in zip(mine, ref))
        w = max(_rel(got[True][1][name][k][i], got[False][1][name][k][i]) for k in got[False][1][name] for i in (0, 1))
        print(f"[{case} {name}: mixed vs time-shared losses / grad norms max rel {worst:.1e}, weights {w:.1e}]")
        assert worst < bar and w < bar, (name, mine, ref)
    model = got[True][2]
    assert model.calculate_metric(adapter_name="a")["step"] == model.calculate_metric(adapter_name="b")["step"] == 3
    assert model.clip_grad_and_step(1.0) == {}


def test_mixed_accumulates_and_keeps_rows_apart(tm, qwen3):
    """Two mixed calls of different proportions, then one step, equal each adapter's rows in one
    call (each loss normalised over its own tokens across the calls); b's dropout leaves a's rows
    alone; logps and metrics come back per adapter; adapters outside the batch are untouched."""
    b_drop = dict(B, lora_dropout=0.2)
    ids, labels = make_batch(3, 6, SEQ, VOCAB)
    adv = torch.tensor([0.5, -1.0, 2.0])
    names = [["a", "b", "a"], ["b", "b", "a"]]
    mixed = _model(tm, qwen3, {"a": A, "b": b_drop, "c": MIX_B})
    mixed.set_loss("grpo", adapter_name="b")
    c_before = _weights(mixed, "c")
    outs = []
    for part, order in zip((slice(0, 3), slice(3, 6)), names):
        rows_adv = torch.zeros(3)
        b_rows = [i for i, n in enumerate(order) if n == "b"]
        flat_b = [i for i, n in enumerate(names[0] + names[1]) if n == "b"]
        rows_adv[b_rows] = adv[[flat_b.index(part.start + i) for i in b_rows]]
        outs.append(mixed.forward_backward(inputs={"input_ids": ids[part], "labels": labels[part]},
                                           adapter_names=order, advantages=rows_adv, return_logps=True))
    norms = mixed.clip_grad_and_step(1.0)
    assert sorted(norms) == ["a", "b"] and sorted(outs[0]) == ["a", "b"]
    alone = _model(tm, qwen3, {"a": A, "b": b_drop, "c": MIX_B})
    alone.set_loss("grpo", adapter_name="b")
    flat = names[0] + names[1]
    rows = {n: [i for i, m in enumerate(flat) if m == n] for n in ("a", "b")}
    ref = {n: alone.forward_backward(inputs={"input_ids": ids[rows[n]], "labels": labels[rows[n]]}, adapter_name=n,
                                     return_logps=True, **({"advantages": adv} if n == "b" else {}))
           for n in ("a", "b")}
    ref_norms = alone.clip_grad_and_step(1.0)
    count_a = outs[0]["a"]["count"] + outs[1]["a"]["count"]
    loss_a = (outs[0]["a"]["loss"] * outs[0]["a"]["count"] + outs[1]["a"]["loss"] * outs[1]["a"]["count"]) / count_a
    assert count_a == ref["a"]["count"] and _rel(loss_a, ref["a"]["loss"]) < 1e-6
    assert outs[0]["b"]["count"] + outs[1]["b"]["count"] == ref["b"]["count"]
    assert _rel(norms["a"], ref_norms["a"]) < 1e-6
    logps_a = torch.cat([outs[0]["a"]["logps"], outs[1]["a"]["logps"]])
    assert logps_a.shape == (3, SEQ) and _rel(logps_a, ref["a"]["logps"]) < 1e-6
    mine, theirs = _weights(mixed, "a"), _weights(alone, "a")
    assert max(_rel(mine[k][i], theirs[k][i]) for k in mine for i in (0, 1)) < 1e-6
    c_after = _weights(mixed, "c")
    assert all(torch.equal(c_before[k][i], c_after[k][i]) for k in c_before for i in (0, 1))
    assert mixed.engine.states["c"].cur_step == 0 and mixed.engine.states["b"].cur_step == 1
    assert mixed.calculate_metric(adapter_name="b")["loss"] == pytest.approx(
        (outs[0]["b"]["loss"] * outs[0]["b"]["count"] + outs[1]["b"]["loss"] * outs[1]["b"]["count"])
        / ref["b"]["count"])


# ---- two processes (gloo): b added after a stepped and after a's DDP wrap ----------------------

MP_B = dict(B, lora_dropout=0.0)    # dropout masks differ with the layout
MP_LAYOUTS = {"dp2_distopt": {"mesh": {"dp_size": 2}, "dist_opt": True},
              "tp2_sp": {"mesh": {"tp_size": 2, "sequence_parallel": True}},
              "pp2_vpp2": {"mesh": {"pp_size": 2, "vpp_size": 2}}}
# mixed batches (a: cross entropy, b: GRPO) under each layout; under PP one row per micro-batch
# and full recompute (the interleaved schedule runs other micro-batches' forwards between a
# micro-batch's forward and its backward, where its layers are recomputed)
RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
MIXED_LAYOUTS = {"mixed_dp2_distopt": {"mesh": {"dp_size": 2}, "dist_opt": True},
                 "mixed_pp2_vpp2_recompute": {"mesh": {"pp_size": 2, "vpp_size": 2}, "spec": {"mbs": 1},
                                              "model_kwargs": RECOMPUTE},
                 "mixed_cp2": {"mesh": {"cp_size": 2}},
                 # packed rows under CP: each token's adapter index follows it into the THD row's zigzag chunks
                 "mixed_cp2_packed": {"mesh": {"cp_size": 2}, "spec": {"packed": True}},
                 # a MoE model, adapters on routed experts (MOE_SPEC): TP2+SP with expert-TP2 and
                 # packed rows (the token index of one THD row sliced with the sequence shard, then
                 # through the dispatcher's expert-TP all-gather; the replicated expert factors'
                 # grads summed over expert-TP; plain rows' [1, B] index needs no slicing, as under
                 # CP and DP); EP2 x DP2 with one row per micro-batch (the other adapters' (expert,
                 # adapter) segments empty on both EP ranks; c's micro-batch carries no expert
                 # adapter at all); TP2+SP x EP2 with expert-TP 1 (each TP rank's sequence shard
                 # through the all-to-all; its experts' grads in the norm)
                 "mixed_tp2_sp_etp2_packed": {"mesh": {"tp_size": 2, "sequence_parallel": True, "etp_size": 2},
                                              "moe": True,
                                              "spec": {"packed": True}},
                 "mixed_ep2": {"mesh": {"ep_size": 2}, "moe": True, "spec": {"mbs": 1}},
                 "mixed_tp2_sp_ep2": {"mesh": {"tp_size": 2, "sequence_parallel": True, "ep_size": 2, "etp_size": 1},
                                      "moe": True}}
# on the MoE model: a on attention and routed experts, b (another rank, rsLoRA, GRPO) on the
# experts' gate_up_proj only, c on attention only (its rows cross the dispatcher with no expert
# adapter, in the same micro-batches as a's and b's)
MOE_SPEC = {"batch": 2,
            "a": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
                  "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                  "init_lora_weights": False},
            "b": {"r": 4, "lora_alpha": 8, "use_rslora": True, "target_modules": None,
                  "target_parameters": ["mlp.experts.gate_up_proj"], "init_lora_weights": False},
            "c": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "o_proj"], "init_lora_weights": False}}


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("multi_lora_moe") / "qwen3_moe"
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
        max_position_embeddings=64, head_dim=16, tie_word_embeddings=False, intermediate_size=128,
        moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
        norm_topk_prob=True))
    model.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def qwen3_tied(tmp_path_factory):
    """The tiny Qwen3 with tied embeddings (as Qwen3-0.6B / 4B): under PP2 megatron keeps a copy
    of the embedding on the last stage."""
    path = tmp_path_factory.mktemp("multi_lora_tied") / "qwen3_tied"
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
        max_position_embeddings=64, head_dim=16, tie_word_embeddings=True, intermediate_size=128,
        num_hidden_layers=2)).save_pretrained(str(path))
    return str(path)


# parameter counts only (the adapters added, nothing trained): the layouts the training runs
# above leave out, where a parameter is held twice: experts replicated over TP (EP1, expert-TP 1;
# whole experts on every TP rank, reduced over the expert data-parallel group) and a tied
# embedding's last-stage copy
COUNT_LAYOUTS = {"counts_tp2_sp_etp1_moe": {"mesh": {"tp_size": 2, "sequence_parallel": True, "etp_size": 1},
                                            "moe": True},
                 "counts_pp2_tied": {"mesh": {"pp_size": 2}, "tied": True}}


@pytest.fixture(scope="module")
def two_ranks(qwen3, qwen3_moe, qwen3_tied, tmp_path_factory):
    import os
    from tests.megatron_workers.protocol import ROOT, launch
    save_dir = str(tmp_path_factory.mktemp("multi_lora_saved"))
    runs = [dict(cfg, name=n) for n, cfg in MP_LAYOUTS.items()]
    runs += [dict(cfg, name=n, mixed=True, **({"model_dir": qwen3_moe, "spec": dict(MOE_SPEC, **cfg.get("spec", {}))}
                                              if cfg.get("moe") else {}))
             for n, cfg in MIXED_LAYOUTS.items()]
    runs += [dict(cfg, name=n, counts_only=True, model_dir=qwen3_moe if cfg.get("moe") else qwen3_tied,
                  **({"spec": MOE_SPEC} if cfg.get("moe") else {}))
             for n, cfg in COUNT_LAYOUTS.items()]
    spec = {"model_dir": qwen3, "batch": BATCH, "seq": SEQ, "vocab": VOCAB, "a": A, "b": MP_B, "mbs": 1,
            "save_dir": save_dir, "runs": runs}
    script = os.path.join(ROOT, "tests", "megatron_workers", "multi_lora_worker.py")
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


@pytest.mark.multiprocess
def test_parameter_counts_equal_one_process(tm, qwen3, qwen3_moe, qwen3_tied, two_ranks):
    """Every adapter's (trainable, total) parameter counts of the whole model, as
    get_train_configs reports them (counted when the adapter is added: the total holds the
    adapters added before it), are the same under every 2-rank layout as in one process, where
    every parameter is local once; the base's total is transformers' count of the checkpoint."""
    from tests.megatron_workers.multi_lora_worker import adapter_counts, adapter_names
    results, _ = two_ranks
    one = {}
    for run, cfg in list(MP_LAYOUTS.items()) + list(MIXED_LAYOUTS.items()) + list(COUNT_LAYOUTS.items()):
        rec = results[run]
        assert rec["ok"], rec.get("traceback")
        path = qwen3_moe if cfg.get("moe") else qwen3_tied if cfg.get("tied") else qwen3
        if path not in one:    # the adapters added in the runs' order, a first
            spec = MOE_SPEC if cfg.get("moe") else {"a": A, "b": MP_B}
            model = tm.MegatronModel(path, device_mesh=tm.DeviceMesh.from_sizes(world_size=1), mixed_precision="fp32")
            for name in adapter_names(spec):
                model.add_adapter_to_model(name, spec[name])
            one[path] = adapter_counts(model)
            del model
        assert rec["counts"] == {n: c for n, c in one[path].items() if n in rec["counts"]}, (run, rec["counts"], one[path])
        assert len(rec["counts"]) >= 2, run
    for path, counts in one.items():
        hf = transformers.AutoModelForCausalLM.from_pretrained(path).num_parameters()   # tied: once
        trainable, total = counts["a"]
        assert total - trainable == hf, (path, total, trainable, hf)


def _spec(packed=False, moe=False):
    return dict({"batch": BATCH, "seq": SEQ, "vocab": VOCAB, "a": A, "b": MP_B, "packed": packed},
                **(MOE_SPEC if moe else {}))


@pytest.fixture(scope="module")
def time_shared_reference(tm, qwen3, qwen3_moe):
    """One process, each adapter's rows sent alone: the mixed runs' reference, by (packed, moe)."""
    from tests.megatron_workers.multi_lora_worker import adapter_names, mixed_or_time_shared
    out = {}

    def get(packed, moe):
        if (packed, moe) not in out:
            model = tm.MegatronModel(qwen3_moe if moe else qwen3, device_mesh=tm.DeviceMesh.from_sizes(world_size=1),
                                     mixed_precision="fp32")
            spec = _spec(packed, moe)
            out[packed, moe] = (mixed_or_time_shared(model, spec, False),
                                {n: _weights(model, n) for n in adapter_names(spec)},
                                {n: model.adapters[n].parameters for n in adapter_names(spec)})
        return out[packed, moe]
    return get


def test_mixed_routed_experts_equals_time_shared(tm, qwen3_moe, time_shared_reference):
    """Qwen3-MoE, one process: a (attention + routed experts), b (experts' gate_up_proj only,
    another rank) and c (attention only) in one mixed batch per step equal each adapter's rows
    sent alone (losses, grad norms, final weights); b's expert factors did train."""
    from tests.megatron_workers.multi_lora_worker import mixed_or_time_shared
    model = tm.MegatronModel(qwen3_moe, device_mesh=tm.DeviceMesh.from_sizes(world_size=1), mixed_precision="fp32")
    rec = mixed_or_time_shared(model, _spec(moe=True), True)
    ref, weights, _ = time_shared_reference(False, True)
    for name in ("a", "b", "c"):
        worst = max(_rel(x, y) for x, y in zip(rec[name], ref[name]))
        mine = _weights(model, name)
        w = max(_rel(mine[k][i], weights[name][k][i]) for k in mine for i in (0, 1))
        print(f"[moe {name}: mixed vs time-shared losses / grad norms max rel {worst:.1e}, weights {w:.1e}]")
        assert worst < 1e-6 and w < 1e-6, (name, rec[name], ref[name])
    assert min(rec["b"][1::2]) > 0 and all(".mlp.experts." in k for k in weights["b"])
    # the mixed call lets go of the dispatchers' routing graphs too (kept, they hold the model)
    dispatchers = [m.token_dispatcher for c in model.unwrapped_chunks() for m in c.modules()
                   if getattr(m, "token_dispatcher", None) is not None]
    assert dispatchers and all(getattr(d, "probs", None) is None for d in dispatchers)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", list(MIXED_LAYOUTS))
def test_mixed_under_two_ranks_equals_time_shared(two_ranks, time_shared_reference, layout):
    """One mixed batch per step under DP2 (distributed optimizer), PP2 with virtual stages,
    CP2, and on a MoE model with adapters on routed experts TP2+SP with expert-TP2 (packed
    rows), EP2 and TP2+SP x EP2, equals one process sending each adapter's rows alone."""
    import os
    from safetensors.torch import load_file
    from twinkle_megatron import lora as tlora
    results, save_dir = two_ranks
    rec = results[layout]
    assert rec["ok"], rec.get("traceback")
    cfg = MIXED_LAYOUTS[layout]
    ref, weights, params = time_shared_reference(bool(cfg.get("spec", {}).get("packed")), bool(cfg.get("moe")))
    for name in weights:
        worst = max(_rel(x, y) for x, y in zip(rec[name], ref[name]))
        saved = load_file(os.path.join(save_dir, f"{layout}_{name}", "adapter_model.safetensors"))
        full = tlora.peft_state_dict(weights[name], params[name])
        assert saved.keys() == full.keys()
        w = max(_rel(saved[k], full[k]) for k in full)
        print(f"[{layout} {name}: mixed vs time-shared losses / grad norms max rel {worst:.1e}, weights {w:.1e}]")
        assert worst < 1e-6 and w < 1e-6, (layout, name, rec[name], ref[name])


@pytest.mark.multiprocess
def test_multi_lora_example_short_run():
    """examples/multi_lora_megatron.py, short, on 2 processes (DP2): three tenants in mixed batches;
    the table is printed and each adapter is best at its own task."""
    import os
    import re
    import subprocess
    import sys
    from tests.megatron_workers.protocol import ROOT
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, os.path.join(ROOT, "examples", "multi_lora_megatron.py"), "--steps", "10",
           "--eval-rows", "16"]
    try:
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400,
                             start_new_session=True)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the multi-LoRA example did not finish in 400 s:\n{(e.stdout or '')[-3000:]}")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    print(out.stdout[-800:])
    rows = {m.group(1): [float(x) for x in m.group(2).split()]
            for m in re.finditer(r"^(add|sort|brackets)\s+([\d. ]+)$", out.stdout, re.M)}
    assert list(rows) == ["add", "sort", "brackets"], out.stdout[-2000:]
    for i, name in enumerate(rows):
        own = rows[name][i]
        assert own > max(v for j, v in enumerate(rows[name]) if j != i), (name, rows)
