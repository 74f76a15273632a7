"""twinkle_megatron.specs: megatron layers on twinkle_kernels, chosen at build time.

In-process: each fused module against megatron's own on random inputs (values and grads).
Multi-process (gloo, timeouts): the same model built with megatron's local spec and with ours,
from identical weights, gives equal losses, grads and grad norms under TP2, TP2+SP, PP2, CP2 and
bf16 (dense) and EP2, TP2xEP2, PP2 (MoE).
"""
import os

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.megatron_workers.launch import launch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
    from twinkle_megatron.specs import TwinkleRMSNorm
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
    from twinkle_megatron.specs import rotate_sbhd
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


def test_layer_spec_substitutes_without_mutating_the_input():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.mlp import MLP
    from twinkle_megatron import specs
    base = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    before = repr(base)
    out = specs.twinkle_layer_spec(base)
    assert repr(base) == before
    assert base.submodules.self_attention.module is SelfAttention
    assert issubclass(out.submodules.self_attention.module, SelfAttention)
    assert out.submodules.self_attention.module is not SelfAttention
    assert out.submodules.input_layernorm is specs.TwinkleRMSNorm
    assert out.submodules.self_attention.submodules.q_layernorm is specs.TwinkleRMSNorm
    assert out.submodules.mlp.module is not MLP and issubclass(out.submodules.mlp.module, MLP)
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
