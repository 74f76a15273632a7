"""Router record / replay on transformers' MoE blocks (twinkle_patches.router_replay, issue 38).

Checked against code written here, not the module's: the recorded ids against plain-torch top-k of
the routers' weights, replayed blocks against a float64 plain-torch MoE block with the forced ids,
replayed log-probs against a float64 copy of the model whose routers this file overrides itself.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import twinkle_patches as tp
from test_patches_models import batch, build

MOE_FAMILIES = ("qwen3_moe", "qwen3_next", "qwen3_5_moe", "mixtral", "glm4_moe", "deepseek_v3")
SOFTMAX = {"qwen3_moe", "qwen3_next", "qwen3_5_moe", "mixtral"}


def _blocks(model):
    """[(block, router)] in layer order: the modules whose ``gate`` is a router (test-side lookup)."""
    return [(m, m.gate) for m in model.modules()
            if type(getattr(m, "gate", None)).__name__.lower().endswith("topkrouter")]


def _capture(model):
    """Hooks (this file's) storing each MoE block's input and output; returns (store, remove)."""
    store, handles = [], []
    for i, (block, _) in enumerate(_blocks(model)):
        handles.append(block.register_forward_hook(
            lambda m, a, o, i=i: store.append((i, a[0].detach().clone(), o.detach().clone()))))
    return store, lambda: [h.remove() for h in handles]


def _forced(b, s, layers, k, e, seed=5):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(b, s, layers, e, generator=g).argsort(-1)[..., :k]


def _plain_weights(family, router, logits, ids):
    """The gate weights at ``ids`` from ``logits`` (any dtype), written from the families' papers /
    transformers' formulas: softmax routers renormalise the top-k probabilities (Qwen3-MoE / -Next only
    with norm_topk_prob), sigmoid routers (DeepSeek-V3, GLM-4-MoE) renormalise the sigmoid scores and
    scale them by routed_scaling_factor."""
    if family in SOFTMAX:
        p = torch.softmax(logits, -1).gather(-1, ids)
        if family in ("qwen3_5_moe", "mixtral") or router.norm_topk_prob:
            p = p / p.sum(-1, keepdim=True)
        return p
    p = torch.sigmoid(logits).gather(-1, ids)
    if router.norm_topk_prob:
        p = p / (p.sum(-1, keepdim=True) + 1e-20)
    return p * router.routed_scaling_factor


def _mlp(mlp, x):
    return F.linear(F.silu(F.linear(x, mlp.gate_proj.weight.double())) * F.linear(x, mlp.up_proj.weight.double()),
                    mlp.down_proj.weight.double())


def _plain_block(family, block, x, ids):
    """The MoE block in float64 plain torch: [T, H] tokens, [T, k] forced ids -> [T, H]."""
    x = x.double()
    router, experts = block.gate, block.experts
    w = _plain_weights(family, router, x @ router.weight.double().T, ids)
    out = torch.zeros_like(x)
    inter = experts.gate_up_proj.shape[1] // 2
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = experts.gate_up_proj[e].double() @ x[t]
            h = F.silu(gu[:inter]) * gu[inter:]
            out[t] += w[t, j] * (experts.down_proj[e].double() @ h)
    if family in ("qwen3_next", "qwen3_5_moe"):
        out = out + torch.sigmoid(x @ block.shared_expert_gate.weight.double().T) * _mlp(block.shared_expert, x)
    if family in ("glm4_moe", "deepseek_v3"):
        out = out + _mlp(block.shared_experts, x)
    return out


def _logps(logits, ids):
    return torch.log_softmax(logits[:, :-1].double(), -1).gather(-1, ids[:, 1:, None])[..., 0]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_recorded_ids_are_the_routers_top_k_and_replay_is_bit_equal(family):
    model = build(family).eval()
    ids = batch()
    store, remove = _capture(model)
    with torch.no_grad():
        want = model(ids).logits
        remove()
        with tp.record_routing(model) as rec:
            got = model(ids).logits
    assert torch.equal(got, want)  # recording changes nothing
    r = rec.routed_experts
    blocks = _blocks(model)
    k = blocks[0][1].top_k
    assert r.dtype == torch.int64 and tuple(r.shape) == (2, 11, len(blocks), k)
    assert rec.report.swapped_names() == [f"{family}:{type(blocks[0][1]).__name__}"]
    for i, x, _ in store:
        router = blocks[i][1]
        scores = x.reshape(-1, x.shape[-1]) @ router.weight.T
        if family in SOFTMAX:
            scores = torch.softmax(scores, -1)
        else:  # n_group = 1 in the tiny configs: the group limit selects every expert
            scores = torch.sigmoid(scores) + router.e_score_correction_bias
        top = scores.topk(k, -1).indices
        assert torch.equal(r[:, :, i].reshape(-1, k).sort(-1).values, top.sort(-1).values), f"layer {i}"
    with torch.no_grad(), tp.replay_routing(model, r) as rep:
        again = model(ids).logits
    assert torch.equal(again, want)
    assert rep.positions_replayed == 11


# the families' defaults, and the other branch of each weight formula: Qwen3-MoE with norm_topk_prob
# (off by default), GLM-4-MoE without it and scaled (1.0 by default)
VARIANTS = {"qwen3_moe/norm": {"norm_topk_prob": True},
            "glm4_moe/unnormed_scaled": {"norm_topk_prob": False, "routed_scaling_factor": 1.7}}


@pytest.mark.parametrize("variant", MOE_FAMILIES + tuple(VARIANTS))
def test_forced_routing_matches_float64_plain_block_and_transformers_logps(variant):
    family = variant.split("/")[0]
    model = build(family).eval()
    for _, router in _blocks(model):
        for attr, value in VARIANTS.get(variant, {}).items():
            setattr(router, attr, value)
    ids = batch()
    blocks = _blocks(model)
    k, e = blocks[0][1].top_k, blocks[0][1].num_experts
    forced = _forced(2, 11, len(blocks), k, e)
    with torch.no_grad():
        natural = model(ids).logits
        store, remove = _capture(model)
        with tp.replay_routing(model, forced):
            got = model(ids).logits
        remove()
    for i, x, y in store:
        want = _plain_block(family, blocks[i][0], x.reshape(-1, x.shape[-1]), forced[:, :, i].reshape(-1, k))
        err = (y.reshape(-1, y.shape[-1]).double() - want).abs().max().item()
        assert err < 1e-5, f"layer {i}: {err}"
    # transformers' own model in float64, its routers made to return the forced ids by this file
    ref = copy.deepcopy(model).double()
    ref.set_experts_implementation("eager")  # grouped_mm has no float64
    for i, (_, router) in enumerate(_blocks(ref)):
        def fwd(h, router=router, i=i):
            h = h.reshape(-1, router.weight.shape[1])
            logits = h @ router.weight.T
            idx = forced[:, :, i].reshape(-1, k)
            return logits, _plain_weights(family, router, logits, idx), idx
        router.forward = fwd
    with torch.no_grad():
        want = ref(ids).logits
    err = (_logps(got, ids) - _logps(want, ids)).abs().max().item()
    assert err < 1e-5, err
    assert (_logps(natural, ids) - _logps(want, ids)).abs().max().item() > 1e-4  # the routing mattered


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_kv_cache_decoding_records_and_replays_per_step(family):
    """Prefill 7 tokens, then 4 one-token steps with a cache: recording appends per step and equals
    the routing of one uncached forward of all 11; replaying a forced routing step by step gives the
    uncached replayed logits."""
    from transformers import DynamicCache
    model = build(family).eval()
    ids = batch()
    blocks = _blocks(model)
    forced = _forced(2, 11, len(blocks), blocks[0][1].top_k, blocks[0][1].num_experts, seed=9)

    def decode():
        cache, outs = DynamicCache(config=model.config), []
        outs.append(model(ids[:, :7], past_key_values=cache, use_cache=True).logits)
        for t in range(7, 11):
            outs.append(model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits)
        return torch.cat(outs, 1)

    with torch.no_grad():
        with tp.record_routing(model) as full:
            model(ids)
        with tp.record_routing(model) as steps:
            decode()
        assert torch.equal(steps.routed_experts, full.routed_experts)
        with tp.replay_routing(model, forced):
            want = model(ids).logits
        with tp.replay_routing(model, forced) as rep:
            got = decode()
        assert rep.positions_replayed == 11
        assert (got - want).abs().max().item() < 1e-5
        with tp.replay_routing(model, forced[:, :10]):  # one position short: the last step is refused
            with pytest.raises(ValueError, match="routed_experts"):
                decode()


def _bad(r, e):
    out = {"rank 3": r[:, :, 0], "wrong k": r[..., :1], "wrong L": torch.cat([r, r], 2),
           "float": r.double(), "bool": r.bool(), "not a tensor": r.tolist()}
    big = r.clone()
    big[1, 3, 0, 1] = e
    neg = r.clone()
    neg[0, 0, 0, 0] = -1
    dup = r.clone()
    dup[0, 5, 0, 1] = dup[0, 5, 0, 0]
    out.update({"id >= num_experts": big, "negative id": neg, "duplicate in one token": dup})
    return out


def test_bad_routed_experts_raise_value_error_naming_the_argument():
    model = build("qwen3_moe").eval()
    ids = batch()
    r = _forced(2, 11, 1, 2, 4)
    for what, bad in _bad(r, 4).items():
        with pytest.raises(ValueError, match="routed_experts") as err:
            tp.replay_routing(model, bad)
        assert what and "routed_experts" in str(err.value)
    assert not any(b._forward_pre_hooks or g._forward_hooks for b, g in _blocks(model))
    with torch.no_grad():
        for short in (r[:1], r[:, :10]):  # rows or positions the forward does not find
            with tp.replay_routing(model, short), pytest.raises(ValueError, match="routed_experts"):
                model(ids)
    with pytest.raises(ValueError, match="model"):
        tp.record_routing(build("llama"))  # no MoE block
    with pytest.raises(ValueError, match="model"):
        tp.record_routing("not a model")


def test_revert_restores_the_exact_modules_and_nothing_is_on_by_default():
    model = build("qwen3_5_moe").eval()
    ids = batch()
    mods = list(model.modules())
    before = [(type(m), dict(m._forward_hooks), dict(m._forward_pre_hooks), "forward" in vars(m)) for m in mods]
    report = tp.apply(model, backend="reference")  # the kernel patches alone leave routing alone
    assert not any("Router" in n for n in report.swapped_names())
    assert all(not g._forward_hooks and not b._forward_pre_hooks for b, g in _blocks(model))
    tp.revert(report)
    rec = tp.record_routing(model)
    assert all(g._forward_hooks and b._forward_pre_hooks for b, g in _blocks(model))
    with torch.no_grad():
        model(ids)
    rec.revert()
    rec.revert()  # once only
    after = [(type(m), dict(m._forward_hooks), dict(m._forward_pre_hooks), "forward" in vars(m)) for m in mods]
    assert after == before and list(model.modules()) == mods
    with torch.no_grad():
        model(ids)  # not recorded any more
    assert rec.routed_experts.shape[1] == 11
    assert "(reverted)" in str(rec.report)
    with tp.replay_routing(model, rec.routed_experts) as rep, pytest.raises(RuntimeError, match="replays"):
        rep.routed_experts

