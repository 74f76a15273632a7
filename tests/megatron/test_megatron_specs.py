"""twinkle_megatron.spec and .layers: megatron layers on twinkle_kernels, chosen at build time.

In-process: each fused module against megatron's own on random inputs (values and grads).
Multi-process (gloo, timeouts): the same model built with megatron's local spec and with ours,
from identical weights, gives equal losses, grads and grad norms under TP2, TP2+SP, PP2, CP2 and
bf16 (dense) and EP2, TP2xEP2, PP2 (MoE).
"""
import os

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.megatron_workers.protocol import launch  # noqa: E402

from conftest import ROOT  # noqa: E402

WORKER = os.path.join(ROOT, "tests", "megatron_spec_worker.py")

DENSE = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
         "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
MOE = dict(DENSE, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=16, norm_topk_prob=True)


class _Cfg:
    sequence_parallel = False
    params_dtype = torch.float32
    layernorm_zero_centered_gamma = False


@pytest.mark.parametrize("zero_centered", [False, True])
def test_rms_norm_matches_reference_and_marks_sequence_parallel(zero_centered):
    from twinkle_megatron.layers.norm import TwinkleRMSNorm
    cfg = _Cfg()
    cfg.layernorm_zero_centered_gamma = zero_centered
    cfg.sequence_parallel = True
    norm = TwinkleRMSNorm(cfg, 24, eps=1e-5)
    assert norm.weight.sequence_parallel is True
    assert float(norm.weight.abs().sum()) == (0.0 if zero_centered else 24.0)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(5, 3, 24, dtype=torch.float64).float().requires_grad_()
    y = norm(x)
    scale = (1.0 + norm.weight) if zero_centered else norm.weight
    xd = x.detach().double().requires_grad_()
    ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * scale.detach().double()
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y)
    y.backward(g)
    ref.backward(g.double())
    torch.testing.assert_close(x.grad.double(), xd.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rot", [8, 4])
def test_rotary_matches_megatron_sbhd_full_and_partial(rot):
    from megatron.core.models.common.embeddings import rope_utils
    from twinkle_megatron.layers.attention import rotate_sbhd
    s, b, hq, hk, d = 7, 3, 4, 2, 8
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    f = torch.outer(torch.arange(s).float(), inv)
    freqs = torch.cat([f, f], -1)[:, None, None, :]            # megatron's [S, 1, 1, R]
    q = torch.randn(s, b, hq, d, requires_grad=True)
    k = torch.randn(s, b, hk, d, requires_grad=True)
    qo, ko = rotate_sbhd(q, k, freqs, freqs)
    q2, k2 = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    qr = rope_utils._apply_rotary_pos_emb_bshd(q2, freqs)
    kr = rope_utils._apply_rotary_pos_emb_bshd(k2, freqs)
    torch.testing.assert_close(qo, qr, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ko, kr, rtol=1e-5, atol=1e-6)
    gq, gk = torch.randn_like(qo), torch.randn_like(ko)
    (qo * gq + 0).sum().backward(retain_graph=True)
    (ko * gk).sum().backward()
    (qr * gq).sum().backward()
    (kr * gk).sum().backward()
    torch.testing.assert_close(q.grad, q2.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(k.grad, k2.grad, rtol=1e-5, atol=1e-6)
    if rot < d:  # the pass-through channels are untouched
        assert torch.equal(qo[..., rot:], q[..., rot:])
    # the cos / sin tables are reused for the same frequency tensor (one per model forward, shared
    # by the layers), and recomputed when it changes in place or another tensor comes
    with torch.no_grad():
        for new in (freqs, freqs.mul_(0.5), freqs * 3.0):
            qo, ko = rotate_sbhd(q, k, new, new)
            torch.testing.assert_close(qo, rope_utils._apply_rotary_pos_emb_bshd(q, new), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(ko, rope_utils._apply_rotary_pos_emb_bshd(k, new), rtol=1e-5, atol=1e-6)


class _OneRank:
    """A stand-in for a one-rank process group (megatron asks such groups for size and rank)."""

    def size(self):
        return 1

    def rank(self):
        return 0


@pytest.mark.parametrize("rot", [8, 4])
def test_packed_thd_rotary_and_attention_match_megatron(rot):
    """Packed (THD) rotary: per-sequence positions from cu_seqlens equal megatron's
    _apply_rotary_pos_emb_thd (an empty sequence included); sdpa_thd equals causal attention on
    each sequence alone."""
    from megatron.core.models.common.embeddings import rope_utils
    from twinkle_megatron.layers.attention import rotate_thd, sdpa_sbhd, sdpa_thd
    t, hq, hk, d = 16, 4, 2, 8
    cu = torch.tensor([0, 3, 3, 10, 16], dtype=torch.int32)
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    f = torch.outer(torch.arange(7).float(), inv)              # max sequence length 7
    freqs = torch.cat([f, f], -1)[:, None, None, :]
    q, k, v = torch.randn(t, hq, d), torch.randn(t, hk, d), torch.randn(t, hk, d)
    qo, ko = rotate_thd(q, k, freqs, cu)
    # megatron's THD rotary asks its CP group for size and rank
    torch.testing.assert_close(qo, rope_utils._apply_rotary_pos_emb_thd(q, cu, freqs, cp_group=_OneRank()),
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ko, rope_utils._apply_rotary_pos_emb_thd(k, cu, freqs, cp_group=_OneRank()),
                               rtol=1e-5, atol=1e-6)
    out = sdpa_thd(q, k, v, cu, 0.3)
    for a, b in ((0, 3), (3, 10), (10, 16)):
        torch.testing.assert_close(out[a:b], sdpa_sbhd(q[a:b, None], k[a:b, None], v[a:b, None], 0.3)[:, 0])


def test_layer_spec_substitutes_without_mutating_the_input():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.mlp import MLP
    from twinkle_megatron import spec as specs, versions
    base = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    before = repr(base)
    out = specs.twinkle_layer_spec(base)
    assert repr(base) == before
    assert base.submodules.self_attention.module is SelfAttention
    assert issubclass(out.submodules.self_attention.module, SelfAttention)
    assert out.submodules.self_attention.module is not SelfAttention
    assert out.submodules.input_layernorm is specs.TwinkleRMSNorm
    assert out.submodules.self_attention.submodules.q_layernorm is specs.TwinkleRMSNorm
    built = versions.built_class(out.submodules.mlp)   # a ModuleSpec, or a builder from megatron-core 0.18
    assert built is not MLP and issubclass(built, MLP)
    assert versions.built_class(base.submodules.mlp) is MLP
    provider = specs.TwinkleSpecProvider()
    assert provider.layer_norm(rms_norm=True) is specs.TwinkleRMSNorm
    assert provider.core_attention()._twinkle_rope_core


def _layout_runs(config, layouts, precision="fp32"):
    return [{"name": name, "mesh": mesh, "config": config, "precision": precision}
            for name, mesh in layouts]


def _check(results, names, loss_tol, grad_tol, grad_key="grad_rel"):
    assert all(r is not None and "error" not in r for r in results), results
    r0 = results[0]
    for name in names:
        rec = r0[name]
        assert "TwinkleRMSNorm" in rec["kinds"], rec["kinds"]
        for a, b in zip(rec["loss"], rec["loss_fused"]):
            assert abs(a - b) <= loss_tol * max(1.0, abs(a)), (name, rec)
        for a, b in zip(rec["norm"], rec["norm_fused"]):
            assert abs(a - b) <= grad_tol * max(1.0, abs(a)), (name, rec)
        for r in results:
            assert max(r[name][grad_key]) <= grad_tol, (name, r[name][grad_key])
        # the loss moved: both models really trained (AdamW step between the two batches)
        assert rec["loss"][0] != rec["loss"][1]


def test_dense_tp2_sp_pp2_cp2_equal_local_spec(tmp_path):
    layouts = [("tp2", {"tp_size": 2}), ("tp2sp", {"tp_size": 2, "sequence_parallel": True}),
               ("pp2", {"pp_size": 2}), ("cp2", {"cp_size": 2})]
    runs = _layout_runs(DENSE, layouts) + [dict(_layout_runs(DENSE, layouts[:1], "bf16")[0], name="tp2bf16")]
    results, codes, logs, _ = launch(2, {"runs": runs}, str(tmp_path), timeout=150, script=WORKER)
    assert codes == [0, 0], "\n".join(t[-3000:] for t in logs)
    _check(results, ["tp2", "tp2sp", "pp2", "cp2"], loss_tol=1e-5, grad_tol=1e-4)
    assert "TwinkleRopeContextParallelAttention" in results[0]["cp2"]["kinds"]
    assert "TwinkleMLP" in results[0]["tp2"]["kinds"]
    assert "TwinkleSelfAttention" in results[0]["tp2"]["kinds"]
    # TwinkleMLP and its linears use the layer's TP group on every rank and layout, also where
    # megatron passes it none (< 0.18: the "Unknown MLP type" warning spec.build_chunks drops)
    bad = [(rank, name) for rank, r in enumerate(results) for name in r if r[name]["mlp_tp_groups"] is not True]
    assert not bad, bad
    # bf16: the same model to bf16 rounding (one rounding order differs in the norm)
    _check(results, ["tp2bf16"], loss_tol=2e-2, grad_tol=1e-1)


def test_moe_ep2_tp2xep2_pp2_equal_local_spec(tmp_path):
    layouts = [("ep2", {"ep_size": 2}),
               ("tp2ep2", {"tp_size": 2, "ep_size": 2, "etp_size": 1, "sequence_parallel": True}),
               ("pp2", {"pp_size": 2})]
    results, codes, logs, _ = launch(2, {"runs": _layout_runs(MOE, layouts)}, str(tmp_path),
                                     timeout=150, script=WORKER)
    assert codes == [0, 0], "\n".join(t[-3000:] for t in logs)
    _check(results, [n for n, _ in layouts], loss_tol=1e-5, grad_tol=1e-4)
    for name, _ in layouts:
        assert "TwinkleGroupedMLP" in results[0][name]["kinds"], results[0][name]["kinds"]


@pytest.fixture
def memory_buffer():
    """megatron's unfused attention takes its score buffer from parallel_state's global buffer
    (allocated on ``torch.cuda.current_device()``: the CPU compatibility layer answers that)."""
    from megatron.core import parallel_state as ps
    from twinkle_megatron.parallel import cpu_compat
    applied = bool(cpu_compat._saved)
    cpu_compat.apply()
    from megatron.core.tensor_parallel import random as mrandom
    had = ps._GLOBAL_MEMORY_BUFFER is not None
    if not had:
        ps._set_global_memory_buffer()
    tracker = mrandom.get_cuda_rng_tracker()   # megatron's dropout forks its model-parallel RNG
    fresh = not tracker.get_states()
    if fresh:
        tracker.add("model-parallel-rng", 1234)
    yield
    if fresh:
        tracker.reset()
    if not had:
        ps.destroy_global_memory_buffer()
    if not applied:
        cpu_compat.revert()


def _core_attention(cls, heads=4, groups=2, dropout=0.0, layer_scaling=False, layer_number=3):
    from types import SimpleNamespace

    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType
    cfg = TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=heads, num_query_groups=groups,
                            kv_channels=8, attention_dropout=dropout, use_cpu_initialization=True,
                            apply_query_key_layer_scaling=layer_scaling, fp16=layer_scaling)
    if layer_scaling:  # only the softmax scale matters here; compute in fp32
        cfg.fp16 = False
    return cls(cfg, layer_number=layer_number, attn_mask_type=AttnMaskType.causal, attention_type="self",
               pg_collection=SimpleNamespace(tp=_OneRank()))


@pytest.mark.parametrize("heads,groups,layer_scaling", [(4, 2, False), (4, 4, False), (4, 1, True)])
def test_core_attention_sdpa_matches_megatron_dot_product_attention(heads, groups, layer_scaling, memory_buffer,
                                                                    monkeypatch):
    """The fused causal attention of the twinkle core attention against megatron's unfused one
    (baddbmm, masked softmax, bmm): values and q/k/v grads, GQA, query-key layer scaling."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from twinkle_megatron.layers import attention as specs
    cls = specs.rope_core_attention(DotProductAttention)
    assert cls._twinkle_sdpa
    ours = _core_attention(cls, heads, groups, layer_scaling=layer_scaling)
    theirs = _core_attention(DotProductAttention, heads, groups, layer_scaling=layer_scaling)
    s, b, d = 12, 3, 8
    q = torch.randn(s, b, heads, d, requires_grad=True)
    k = torch.randn(s, b, groups, d, requires_grad=True)
    v = torch.randn(s, b, groups, d, requires_grad=True)
    called = []
    real = specs.sdpa_sbhd
    monkeypatch.setattr(specs, "sdpa_sbhd", lambda *a: called.append(1) or real(*a))
    out = ours(q, k, v, None, attn_mask_type=None, attention_bias=None, packed_seq_params=None)
    assert called, "the fused path was not taken"
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref = theirs(q2, k2, v2, None)
    assert out.shape == ref.shape == (s, b, heads * d)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    for a, r in ((q, q2), (k, k2), (v, v2)):
        torch.testing.assert_close(a.grad, r.grad, rtol=1e-4, atol=1e-5)


def test_core_attention_falls_back_to_megatron_for_masks_and_dropout(memory_buffer, monkeypatch):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from twinkle_megatron.layers import attention as specs
    cls = specs.rope_core_attention(DotProductAttention)
    s, b = 6, 2
    q, k, v = torch.randn(s, b, 4, 8), torch.randn(s, b, 2, 8), torch.randn(s, b, 2, 8)
    calls = []
    real = specs.sdpa_sbhd
    monkeypatch.setattr(specs, "sdpa_sbhd", lambda *a: calls.append(1) or real(*a))
    # an explicit mask (True = masked out): megatron's path, same result as megatron
    mask = torch.zeros(1, 1, s, s, dtype=torch.bool)
    mask[..., 0] = True
    ours, theirs = _core_attention(cls), _core_attention(DotProductAttention)
    torch.testing.assert_close(ours(q, k, v, mask), theirs(q, k, v, mask))
    # active dropout in training: megatron's path (it owns the RNG)
    drop = _core_attention(cls, dropout=0.5).train()
    drop(q, k, v, None)
    assert not calls
    drop.eval()(q, k, v, None)        # eval: dropout is off, the fused path serves it
    assert calls
    # devices other than CPU / CUDA (NPU has its own attention patches) are not served
    meta = [t.to("meta") for t in (q, k, v)]
    assert specs._sdpa_scale(ours, *meta, (None,), {}) is None
    assert specs._sdpa_scale(ours, q, k, v, (None,), {}) is not None
