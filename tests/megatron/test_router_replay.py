"""MoE router replay on the facade (issue 38): ``forward_only(return_routed_experts=True)`` and
``routed_experts=R`` on ``forward_only`` / ``forward_backward``.

- recorded ids equal transformers' router top-k (a hook on its gate reads them), at every token
  the attention mask keeps;
- a forced (random, valid) routing replayed on the facade gives the log-probs and loss of float64
  transformers forced to the same ids (its gate's forward patched here: softmax over all experts
  gathered at the ids, renormalised when ``norm_topk_prob``), within 1e-5, for a renormalising
  and a non-renormalising Qwen3-MoE;
- DeepSeek-V3 and GLM-4-MoE (sigmoid scores, expert bias, group-limited top-k, scaled weights, a
  dense first layer): recorded ids are transformers' choice, forced routing its forced log-probs;
- replay with full activation recompute equals replay without over 3 steps (megatron's
  REPLAY_BACKWARD: the rerun pops the micro-batch's ids), and replay changes the result;
- a mixed-adapter batch replays each adapter's rows as if sent alone; with the aux loss on, a
  replayed forward reports transformers' aux loss of the same forced forward (the router's own
  top-k counted);
- EP2, CP2, PP2 (two micro-batches, without recompute, with full recompute and with megatron's
  selective recompute of the MoE layer), LoRA under EP2 and packed rows
  under EP2 and under CP2 on 2 gloo ranks, TP2+SP x EP2 with expert TP 2 (given), with
  expert TP 1 (the default, with recompute) and with expert TP 1 given, and PP2 x VPP2 x DP2 on 4, equal the
  single-process replayed run over 3 steps within 1e-6 (loss, grad norm, then the replayed
  log-probs), and record the same routing afterwards;
- bad ``routed_experts`` (shape, dtype, an id >= num_experts or < 0, duplicate ids in one token's
  k) raise ValueError naming it, on every rank; garbage where the attention mask is 0 is ignored.
"""
import os

import pytest
import torch

pytest.importorskip("megatron.core")

from conftest import megatron_one_rank  # noqa: E402
from tests.megatron_workers.protocol import ROOT, launch  # noqa: E402
from tests.megatron_workers.router_replay_worker import build, replay_run  # noqa: E402

VOCAB, B, S, E, K, LAYERS, STEPS = 128, 4, 12, 8, 2, 4, 3
WORKER = os.path.join(ROOT, "tests", "megatron_workers", "router_replay_worker.py")
MOE = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=64, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, intermediate_size=128,
           moe_intermediate_size=32, num_experts=E, num_experts_per_tok=K, num_hidden_layers=LAYERS, head_dim=16,
           norm_topk_prob=True, tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=10000.0,
           decoder_sparse_step=1, mlp_only_layers=[], torch_dtype="float32")
RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


def _checkpoint(tm, norm_topk_prob: bool, root) -> str:
    """A tiny Qwen3-MoE written by the facade itself (transformers is not needed to make it), its
    routers scaled up so that routing is far from uniform (distinct top-k, a forced routing
    matters)."""
    model = tm.MegatronModel(dict(MOE, norm_topk_prob=norm_topk_prob), mixed_precision="fp32", load_weights=False)
    with torch.no_grad():
        for name, p in model.unwrapped_chunks()[0].named_parameters():
            if name.endswith("mlp.router.weight"):
                p.mul_(25.0)
    return model.save(f"qwen3_moe_{'norm' if norm_topk_prob else 'plain'}", str(root))


def _hf(path: str):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).double()
    hf.set_experts_implementation("eager")   # torch._grouped_mm has no float64
    return hf


def random_routing(b, s, generator) -> torch.Tensor:
    """Valid ids [b, s, LAYERS, K]: K distinct experts per token and layer."""
    return torch.rand(b, s, LAYERS, E, generator=generator).argsort(-1)[..., :K]


def _data():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, 9:] = 0
    mask[3, 7:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :2] = -100
    routed = random_routing(B, S, g)
    routed[1, 9:] = -1       # garbage where the mask is 0: ignored
    packed_pos = torch.cat([torch.arange(5), torch.arange(7)]).expand(B, S).clone()
    packed_labels = ids.clone()
    packed_labels[:, 5] = -100
    data = {"input_ids": ids, "labels": labels, "attention_mask": mask, "routed": routed,
            "packed_input_ids": ids, "packed_labels": packed_labels, "packed_position_ids": packed_pos,
            "packed_routed": random_routing(B, S, g)}
    bad = random_routing(B, S, g)
    bad[0, 4, 2] = torch.tensor([3, 3])         # duplicate ids, on data-parallel rank 0's rows only
    data["bad_duplicate"] = bad
    big = random_routing(B, S, g)
    big[0, 2, 0, 1] = E                         # id >= num_experts
    data["bad_range"] = big
    data["bad_shape"] = random_routing(B, S, g)[:, :, :3]
    return data


@pytest.fixture(scope="module")
def one_rank():
    with megatron_one_rank() as tm:
        yield tm


@pytest.fixture(scope="module")
def setup(one_rank, tmp_path_factory):
    root = tmp_path_factory.mktemp("router_replay")
    paths = {"norm": _checkpoint(one_rank, True, root), "plain": _checkpoint(one_rank, False, root)}
    data = _data()
    torch.save(data, str(root / "data.pt"))
    return {"root": root, "paths": paths, "data": data}


def _gates(hf):
    return [m for n, m in hf.named_modules() if n.endswith("mlp.gate")]


def _registry():
    """The patch registry's router replay (twinkle_patches.record_routing / replay_routing), or
    None where the installed twinkle_patches predates it (a stale install on the test machine)."""
    import twinkle_patches as tp
    return tp if hasattr(tp, "replay_routing") else None


def hf_topk(hf, batch):
    """transformers' router top-k ids [B, S, LAYERS, K], read by a forward hook on every gate; the
    patch registry's ``record_routing`` (what a transformers sampler returns for R3) records the
    same, where installed."""
    got = []
    hooks = [g.register_forward_hook(lambda mod, args, out: got.append(out[2])) for g in _gates(hf)]
    try:
        with torch.no_grad():
            hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    finally:
        for h in hooks:
            h.remove()
    b, s = batch["input_ids"].shape
    ids = torch.stack([x.reshape(b, s, -1) for x in got], 2)
    tp = _registry()
    if tp is not None:
        with torch.no_grad(), tp.record_routing(hf) as rec:
            hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        assert torch.equal(rec.routed_experts.sort(-1).values, ids.sort(-1).values)
    return ids


def _logps(logits, batch):
    """Float64 log-probs [B, S] in the facade's alignment (0 at t = 0 and where the label is -100)
    and their token-mean loss (transformers' own loss upcasts the logits to float32 only)."""
    labels = batch["labels"]
    lp = torch.log_softmax(logits, -1)[:, :-1].gather(2, labels[:, 1:, None].clamp(min=0))[..., 0]
    mask = labels[:, 1:] != -100
    logps = torch.zeros(lp.shape[0], lp.shape[1] + 1, dtype=lp.dtype)
    logps[:, 1:] = lp * mask
    return float(-logps.sum() / mask.sum()), logps


def hf_forced(hf, batch, routed, weights):
    """transformers' (float64) loss and log-probs [B, S] with every gate overridden to route by
    ``routed``, its weights ``weights(router_logits [T, E], ids [T, K])`` (the family's gate
    weights at the ids); the patch registry's ``replay_routing`` gives the same logits, where
    installed."""
    ids, mask = batch["input_ids"], batch["attention_mask"]

    def force(layer):
        def hook(mod, args, out):
            i = routed[:, :, layer].reshape(-1, routed.shape[-1])
            return out[0], weights(out[0], i).to(out[1].dtype), i
        return hook

    hooks = [g.register_forward_hook(force(i)) for i, g in enumerate(_gates(hf))]
    try:
        with torch.no_grad():
            z = hf(input_ids=ids, attention_mask=mask).logits
    finally:
        for h in hooks:
            h.remove()
    tp = _registry()
    if tp is not None:
        with torch.no_grad(), tp.replay_routing(hf, routed):
            z_reg = hf(input_ids=ids, attention_mask=mask).logits
        assert float((z - z_reg).abs().max()) <= 1e-10
    return _logps(z, batch)


def softmax_weights(norm: bool):
    def weights(logits, ids):
        w = torch.softmax(logits, -1, dtype=torch.float).gather(1, ids)
        return w / w.sum(-1, keepdim=True) if norm else w
    return weights


def _clean(data):
    """The routing the facade replays: the given ids where the mask is 1."""
    real = data["attention_mask"].bool()[..., None, None]
    return torch.where(real, data["routed"], torch.arange(K).expand_as(data["routed"]))


@pytest.mark.parametrize("family", ["norm", "plain"])
def test_recorded_ids_equal_transformers_topk(one_rank, setup, family):
    data, hf = setup["data"], _hf(setup["paths"][family])
    model = one_rank.MegatronModel(setup["paths"][family], mixed_precision="fp32")
    out = model.forward_only(inputs={k: data[k] for k in ("input_ids", "labels", "attention_mask")},
                             return_routed_experts=True)
    got = out["routed_experts"]
    assert got.dtype == torch.int64 and got.shape == (B, S, LAYERS, K)
    want = hf_topk(hf, data)
    real = data["attention_mask"].bool()
    # each token's ids by descending gate weight, as transformers' topk orders them
    assert torch.equal(got[real], want[real]), (got[real] != want[real]).nonzero()[:5]
    # the facade's routers stay off megatron's process-wide list (several models per process)
    from megatron.core.transformer.moe.router_replay import RouterReplay
    from twinkle_megatron.training import router_replay
    mine = {id(r.router_replay) for r in router_replay.routers(model.unwrapped_chunks()[0])}
    assert len(mine) == LAYERS and not mine & {id(r) for r in RouterReplay.global_router_replay_instances}


@pytest.mark.parametrize("family,twinkle", [("norm", False), ("plain", False), ("norm", True)])
def test_forced_routing_equals_transformers_forced(one_rank, setup, family, twinkle):
    """``twinkle``: the twinkle_kernels layers (grouped experts, fused LM head) take the replayed
    routing too."""
    data, hf = setup["data"], _hf(setup["paths"][family])
    batch = {k: data[k] for k in ("input_ids", "labels", "attention_mask")}
    model = one_rank.MegatronModel(setup["paths"][family], mixed_precision="fp32", use_twinkle_kernels=twinkle)
    model.set_optimizer("AdamW", lr=1e-3)
    want_loss, want = hf_forced(hf, batch, _clean(data), softmax_weights(hf.config.norm_topk_prob))
    out = model.forward_only(inputs=batch, routed_experts=data["routed"], return_routed_experts=True)
    err = float((out["logps"].double() - want).abs().max())
    free = model.forward_only(inputs=batch)
    unforced = float((free["logps"].double() - want).abs().max())
    print(f"[{family}{' twinkle' if twinkle else ''}: replayed logps max err {err:.2e}, unforced {unforced:.2e}, "
          f"loss {abs(out['loss'] - want_loss):.2e}]")
    assert err <= 1e-5 and abs(out["loss"] - want_loss) <= 1e-5 * max(1.0, abs(want_loss))
    assert unforced > 1e-3        # the forced routing is not the router's own
    real = data["attention_mask"].bool()
    assert torch.equal(out["routed_experts"][real], data["routed"][real])   # the routing used
    fb = model.forward_backward(inputs=batch, routed_experts=data["routed"])
    assert abs(fb["loss"] - want_loss) <= 1e-5 * max(1.0, abs(want_loss))
    model.zero_grad()


def test_aux_loss_with_replay_counts_the_routers_own_topk(one_rank, setup):
    """With the MoE aux loss on, a replayed forward reports transformers' aux loss of the same
    forced forward: ``load_balancing_loss_func`` recomputes the top-k from the router logits, so
    it counts the router's own choice, not the imposed ids; the facade does the same."""
    data, hf = setup["data"], _hf(setup["paths"]["norm"])
    batch = {k: data[k] for k in ("input_ids", "labels", "attention_mask")}
    routed = _clean(data)
    weights = softmax_weights(True)

    def force(layer):
        def hook(mod, args, out):
            i = routed[:, :, layer].reshape(-1, K)
            return out[0], weights(out[0], i).to(out[1].dtype), i
        return hook

    hooks = [g.register_forward_hook(force(i)) for i, g in enumerate(_gates(hf))]
    try:
        with torch.no_grad():
            ref = hf(**batch, output_router_logits=True)
    finally:
        for h in hooks:
            h.remove()
    model = one_rank.MegatronModel(setup["paths"]["norm"], mixed_precision="fp32", router_aux_loss_coef=0.1)
    out = model.forward_only(inputs=batch, routed_experts=data["routed"])
    free = model.forward_only(inputs=batch)
    err = abs(out["aux_loss"] - float(ref.aux_loss))
    print(f"[aux loss with replay {out['aux_loss']:.6f} vs transformers forced {float(ref.aux_loss):.6f}: "
          f"{err:.1e}; without replay {free['aux_loss']:.6f}]")
    assert err <= 1e-5 * max(1.0, float(ref.aux_loss))
    assert abs(free["aux_loss"] - out["aux_loss"]) > 1e-5   # the layers' inputs, hence the logits, differ


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_score_function_families_replay_like_transformers(one_rank, tmp_path, family):
    """Sigmoid scores, an expert bias that only chooses, group-limited top-k, renormalised and
    scaled weights, a dense first layer (L_moe = 3 of 4 layers): the recorded ids are transformers'
    choice, and a forced routing gives transformers' forced log-probs (its gate's weights: the
    sigmoid scores gathered at the ids, without the bias, renormalised, times the scaling factor)."""
    pytest.importorskip("transformers")
    from tests.megatron.test_families import VOCAB as V, hf_model
    hf = hf_model(family)
    hf.save_pretrained(str(tmp_path / family))
    hf = hf.double()
    hf.set_experts_implementation("eager")
    cfg = hf.config
    k, e, moe_layers = cfg.num_experts_per_tok, cfg.n_routed_experts, cfg.num_hidden_layers - cfg.first_k_dense_replace
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, V, (2, 10), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    model = one_rank.MegatronModel(str(tmp_path / family), mixed_precision="fp32")
    got = model.forward_only(inputs=batch, return_routed_experts=True)["routed_experts"]
    assert got.shape == (2, 10, moe_layers, k)
    want_ids = hf_topk(hf, batch)
    assert torch.equal(got.sort(-1).values, want_ids.sort(-1).values)   # transformers: unsorted
    routed = torch.rand(2, 10, moe_layers, e, generator=g).argsort(-1)[..., :k]

    def weights(logits, i):
        w = logits.sigmoid().gather(1, i)
        return w / (w.sum(-1, keepdim=True) + 1e-20) * cfg.routed_scaling_factor

    _, want = hf_forced(hf, batch, routed, weights)
    out = model.forward_only(inputs=batch, routed_experts=routed)
    free = model.forward_only(inputs=batch)
    err = float((out["logps"].double() - want).abs().max())
    unforced = float((free["logps"].double() - want).abs().max())
    print(f"[{family}: replayed logps max err {err:.2e}, unforced {unforced:.2e}]")
    assert err <= 1e-5 and unforced > 1e-3


def test_mixed_adapter_batch_replays_each_row(one_rank, setup):
    """forward_backward(adapter_names=...) with routed_experts: each adapter's loss equals its
    rows sent alone with their rows of the routing."""
    data = setup["data"]
    batch = {k: data[k] for k in ("input_ids", "labels", "attention_mask")}
    model = one_rank.MegatronModel(setup["paths"]["norm"], mixed_precision="fp32")
    for name in ("a", "b"):
        model.add_adapter_to_model(name, {"r": 4, "lora_alpha": 8, "target_modules": "all-linear",
                                          "init_lora_weights": False})
        model.set_optimizer("AdamW", lr=1e-3, adapter_name=name)
    names, alone = ["a", "b", "b", "a"], {}
    for name in ("a", "b"):
        rows = [i for i, n in enumerate(names) if n == name]
        alone[name] = model.forward_backward(inputs={k: v[rows] for k, v in batch.items()}, adapter_name=name,
                                             routed_experts=data["routed"][rows])["loss"]
    mixed = model.forward_backward(inputs=batch, adapter_names=names, routed_experts=data["routed"])
    free = model.forward_backward(inputs=batch, adapter_names=names)
    errs = {n: _rel(mixed[n]["loss"], alone[n]) for n in alone}
    print(f"[mixed vs alone: {errs}; unreplayed differs by {abs(free['a']['loss'] - alone['a']):.1e}]")
    assert max(errs.values()) <= 1e-6 and abs(free["a"]["loss"] - alone["a"]) > 1e-5


def _reference(one_rank, setup, lora=False, packed=False, mbs=None, model_kwargs=None):
    key = ("ref", lora, packed, tuple(sorted((model_kwargs or {}).items())))
    if key not in setup:
        model = build(one_rank, setup["paths"]["norm"], None, model_kwargs, lora)
        setup[key] = replay_run(model, setup["data"], STEPS, slice(None), mbs, packed)
    return setup[key]


def _rel(a, b):
    return abs(a - b) / max(1.0, abs(b))


def test_replay_with_recompute_equals_replay_without(one_rank, setup):
    ref = _reference(one_rank, setup)
    rec = _reference(one_rank, setup, model_kwargs=RECOMPUTE)
    free = build(one_rank, setup["paths"]["norm"])
    batch = {k: setup["data"][k] for k in ("input_ids", "labels", "attention_mask")}
    unreplayed = free.forward_backward(inputs=batch)["loss"]
    free.zero_grad()
    errs = [_rel(a, b) for a, b in zip(rec["loss"] + rec["norm"], ref["loss"] + ref["norm"])]
    lp = float((torch.tensor(rec["logps"]) - torch.tensor(ref["logps"])).abs().max())
    print(f"[recompute vs not: loss/norm max rel {max(errs):.2e}, logps {lp:.2e}; "
          f"unreplayed loss differs by {abs(unreplayed - ref['loss'][0]):.2e}]")
    assert max(errs) <= 1e-6 and lp <= 1e-6
    assert abs(unreplayed - ref["loss"][0]) > 1e-5     # rounding differences are ~1e-7


def test_bad_routed_experts_raise_value_error(one_rank, setup):
    data = setup["data"]
    batch = {k: data[k] for k in ("input_ids", "labels", "attention_mask")}
    model = one_rank.MegatronModel(setup["paths"]["norm"], mixed_precision="fp32")
    model.set_optimizer("AdamW", lr=1e-3)
    cases = {"bad_duplicate": "must differ", "bad_range": r"\[0, 8\)", "bad_shape": r"\[4, 12, 4, 2\]"}
    for key, match in cases.items():
        for call in (model.forward_only, model.forward_backward):
            with pytest.raises(ValueError, match="routed_experts.*" + match):
                call(inputs=batch, routed_experts=data[key])
    neg = data["routed"].clone()
    neg[0, 3, 1, 0] = -2
    with pytest.raises(ValueError, match="routed_experts"):
        model.forward_only(inputs=batch, routed_experts=neg)
    with pytest.raises(ValueError, match="routed_experts.*integer"):
        model.forward_only(inputs=batch, routed_experts=data["routed"].float())
    assert model.forward_only(inputs=batch, routed_experts=data["routed"].to(torch.int32).numpy())["loss"] > 0


def test_dense_model_refuses_routing(one_rank, tmp_path):
    from twinkle_megatron.job.configs import tiny_qwen3_config
    cfg = dict(tiny_qwen3_config(num_layers=1), hidden_size=32, intermediate_size=64, num_attention_heads=2,
               num_key_value_heads=1, head_dim=16)
    model = one_rank.MegatronModel(cfg, mixed_precision="fp32", load_weights=False)
    ids = torch.randint(0, 100, (1, 6))
    with pytest.raises(ValueError, match="return_routed_experts.*no MoE"):
        model.forward_only(inputs={"input_ids": ids, "labels": ids}, return_routed_experts=True)
    with pytest.raises(ValueError, match="routed_experts.*no MoE"):
        model.forward_only(inputs={"input_ids": ids, "labels": ids}, routed_experts=torch.zeros(1, 6, 1, 1))


TWO = [{"name": "ep2", "mesh": {"ep_size": 2}},
       {"name": "ep2_recompute", "mesh": {"ep_size": 2}, "model_kwargs": RECOMPUTE},
       {"name": "ep2_lora", "mesh": {"ep_size": 2}, "lora": True},
       {"name": "ep2_packed", "mesh": {"ep_size": 2}, "packed": True},
       {"name": "cp2", "mesh": {"cp_size": 2}},
       {"name": "cp2_packed", "mesh": {"cp_size": 2}, "packed": True},
       {"name": "pp2", "mesh": {"pp_size": 2}, "mbs": 2},
       {"name": "pp2_recompute", "mesh": {"pp_size": 2}, "mbs": 2, "model_kwargs": RECOMPUTE},
       {"name": "pp2_recompute_moe", "mesh": {"pp_size": 2}, "mbs": 2,
        "model_kwargs": {"recompute_granularity": "selective", "recompute_modules": ["moe"]}},
       {"name": "bad_duplicate", "mesh": {"ep_size": 2}, "bad": "bad_duplicate", "expect_error": True},
       {"name": "bad_range", "mesh": {"ep_size": 2}, "bad": "bad_range", "expect_error": True}]
FOUR = [{"name": "tp2_sp_ep2", "mesh": {"tp_size": 2, "sequence_parallel": True, "ep_size": 2, "etp_size": 2}},
        {"name": "tp2_sp_ep2_recompute", "mesh": {"tp_size": 2, "sequence_parallel": True, "ep_size": 2},
         "model_kwargs": RECOMPUTE},
        {"name": "tp2_sp_ep2_etp1", "mesh": {"tp_size": 2, "sequence_parallel": True, "ep_size": 2, "etp_size": 1}},
        {"name": "pp2_vpp2_dp2", "mesh": {"pp_size": 2, "vpp_size": 2}, "mbs": 1}]


def _check_layouts(one_rank, setup, runs, res):
    worst = {}
    for run in runs:
        recs = [r[run["name"]] for r in res]
        if run.get("bad"):
            for rank, rec in enumerate(recs):   # every rank, also those whose rows are fine
                assert not rec["ok"] and "ValueError" in rec["error"] and "routed_experts" in rec["error"], (rank, rec)
            continue
        for rec in recs:
            assert rec["ok"], rec.get("traceback")
        ref = _reference(one_rank, setup, lora=run.get("lora", False), packed=run.get("packed", False))
        dps = max(r["dp"] for r in recs) + 1
        n = B // dps
        steps, lps = [], []
        want_lp = torch.tensor(ref["logps"])
        for rec in recs:
            steps += [_rel(a, b) for a, b in zip(rec["loss"] + rec["norm"], ref["loss"] + ref["norm"])]
            rows = slice(rec["dp"] * n, (rec["dp"] + 1) * n)
            lps.append(float((torch.tensor(rec["logps"]) - want_lp[rows]).abs().max() / want_lp.abs().max()))
            assert torch.equal(torch.tensor(rec["recorded"]), torch.tensor(ref["recorded"])[rows]), run["name"]
        worst[run["name"]] = (max(steps), max(lps))
    print("[loss/norm rel, logps rel: " + ", ".join(f"{k} {a:.1e} {b:.1e}" for k, (a, b) in worst.items()) + "]")
    assert max(max(v) for v in worst.values()) <= 1e-6, worst


@pytest.mark.multiprocess
def test_two_rank_layouts_equal_single_process(one_rank, setup):
    spec = {"model_dir": setup["paths"]["norm"], "data": str(setup["root"] / "data.pt"), "steps": STEPS,
            "runs": TWO}
    res, rcs, logs, elapsed = launch(2, spec, str(setup["root"] / "two"), timeout=600, script=WORKER)
    assert rcs == [0, 0] and all(r is not None for r in res), "\n".join(l[-3000:] for l in logs)
    print(f"[2 ranks: {elapsed:.1f}s]")
    _check_layouts(one_rank, setup, TWO, res)


@pytest.mark.multiprocess
def test_four_rank_layouts_equal_single_process(one_rank, setup):
    spec = {"model_dir": setup["paths"]["norm"], "data": str(setup["root"] / "data.pt"), "steps": STEPS,
            "runs": FOUR}
    res, rcs, logs, elapsed = launch(4, spec, str(setup["root"] / "four"), timeout=600, script=WORKER)
    assert rcs == [0] * 4 and all(r is not None for r in res), "\n".join(l[-3000:] for l in logs)
    print(f"[4 ranks: {elapsed:.1f}s]")
    _check_layouts(one_rank, setup, FOUR, res)
