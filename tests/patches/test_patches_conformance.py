"""Patched models keep transformers' own switches and outputs.

What a user's existing transformers code relies on, checked with the patches applied against the
same model unpatched: the experts-implementation switch, every rotary-embedding variant the
patched families use, the returned outputs (hidden states, attentions, router logits), and the
activations a patch cannot serve (they keep the original forward).
"""
from __future__ import annotations

import importlib
from unittest import mock

import pytest
import torch

import twinkle_kernels as tk
import twinkle_patches as tp
from twinkle_kernels import testing

from test_patches_models import batch, build

pytestmark = [pytest.mark.filterwarnings("ignore"), pytest.mark.timeout(300)]

BUILTIN_EXPERTS = ("eager", "batched_mm", "grouped_mm")


@pytest.fixture(autouse=True)
def _clean_patches():
    tp.revert()
    yield
    tp.revert()


@pytest.fixture
def moe_calls(monkeypatch):
    """Counts calls of twinkle_kernels.moe_experts and of transformers' batched/grouped experts."""
    from transformers.integrations import moe as hf_moe
    calls = {"moe_experts": 0}
    fn = tk.moe_experts

    def spy(*a, **k):
        calls["moe_experts"] += 1
        return fn(*a, **k)
    monkeypatch.setattr(tk, "moe_experts", spy)
    mapping = hf_moe.ALL_EXPERTS_FUNCTIONS._global_mapping
    for name in ("batched_mm", "grouped_mm"):
        m = mock.Mock(wraps=mapping[name])
        monkeypatch.setitem(mapping, name, m)
        calls[name] = m
    return calls


def _reset(calls):
    calls["moe_experts"] = 0
    calls["batched_mm"].reset_mock()
    calls["grouped_mm"].reset_mock()


def _check_ran(calls, impl):
    assert (calls["moe_experts"] > 0) == (impl == "twinkle"), (impl, calls["moe_experts"])
    assert calls["batched_mm"].called == (impl == "batched_mm"), impl
    assert calls["grouped_mm"].called == (impl == "grouped_mm"), impl


def _logits_per_impl(model, ids, impls):
    out = {}
    with torch.no_grad():
        for impl in impls:
            model.set_experts_implementation(impl)
            assert model.config._experts_implementation == impl
            out[impl] = model(input_ids=ids).logits
    return out


# -- experts implementation ------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_experts_switch_built_after_apply(family, moe_calls):
    """SiLU experts (the MoE path really runs): every built-in selection runs transformers' code
    with the patches applied, bit-identical to unpatched; "twinkle" is the default and runs the op."""
    ids = batch(t=5)
    want = _logits_per_impl(build(family).eval(), ids, BUILTIN_EXPERTS)
    torch.testing.assert_close(want["batched_mm"], want["eager"], atol=1e-5, rtol=1e-5)
    tp.apply(families=[family], ops=("experts",))
    model = build(family).eval()
    assert model.config._experts_implementation == "twinkle"  # the default while patched
    for impl in BUILTIN_EXPERTS + ("twinkle",):
        _reset(moe_calls)
        with torch.no_grad():
            model.set_experts_implementation(impl)
            got = model(input_ids=ids).logits
        _check_ran(moe_calls, impl)
        if impl == "twinkle":
            atol, rtol = testing.tolerance(torch.float32, "moe_experts")
            torch.testing.assert_close(got, want["eager"], atol=atol, rtol=rtol)
        else:
            assert torch.equal(got, want[impl]), impl
    # an explicit request at build time is honoured too
    cls = type(model)
    explicit = cls._from_config(model.config.__class__(**model.config.to_dict()), experts_implementation="batched_mm")
    assert explicit.config._experts_implementation == "batched_mm"
    tp.revert()
    # a model built while patched goes back to transformers' default: "twinkle" left the registry
    assert model.config._experts_implementation == "grouped_mm"
    _reset(moe_calls)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, want["grouped_mm"])
    _check_ran(moe_calls, "grouped_mm")


def test_experts_switch_model_given_to_apply(moe_calls):
    """apply(model) switches transformers' default (grouped_mm) to "twinkle" and revert restores it;
    a selection made by the user is left alone and reported."""
    ids = batch(t=5)
    model = build("qwen3_moe").eval()
    assert model.config._experts_implementation == "grouped_mm"
    report = tp.apply(model, ops=("experts",))
    assert model.config._experts_implementation == "twinkle"
    assert "config" in [s.where for s in report.swapped], report
    _reset(moe_calls)
    with torch.no_grad():
        model(input_ids=ids)
    _check_ran(moe_calls, "twinkle")
    tp.revert(report)
    assert model.config._experts_implementation == "grouped_mm"

    model.set_experts_implementation("batched_mm")
    report = tp.apply(model, ops=("experts",))
    assert model.config._experts_implementation == "batched_mm"
    assert "left as is" in report.skipped_reasons()["qwen3_moe:Qwen3MoeExperts"], report
    _reset(moe_calls)
    with torch.no_grad():
        model(input_ids=ids)
    _check_ran(moe_calls, "batched_mm")


# -- rotary variants -------------------------------------------------------------------------------
# The patch replaces apply_rotary_pos_emb only: every rope_type's frequencies (and Qwen3.5's
# interleaved multimodal sections) are computed by transformers' own rotary module, so patched
# logits must equal unpatched ones for each variant.

ROPE_VARIANTS = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
}


def _with_rope(family, params):
    from test_patches_models import _CAUSAL_LM, _cfg
    cfg = _cfg(family)
    cfg.rope_parameters = {**dict(cfg.rope_parameters or {}), **params}
    cfg._attn_implementation = "eager"
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    torch.manual_seed(0)
    return getattr(mod, _CAUSAL_LM[family])(cfg).eval()


def _rope_close(got, want):
    atol, rtol = testing.tolerance(torch.float32)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("variant", sorted(ROPE_VARIANTS))
def test_rope_variant_logits_match(variant):
    """Sequences past original_max_position_embeddings, so the scaled variants really differ."""
    model = _with_rope("llama", ROPE_VARIANTS[variant])
    ids = batch(t=72)  # past max_position_embeddings (64) too: dynamic rescales only there
    with torch.no_grad():
        want = model(input_ids=ids).logits
        report = tp.apply(model, ops=("rope",))
        assert "llama:apply_rotary_pos_emb" in report.swapped_names(), report
        got = model(input_ids=ids).logits
    _rope_close(got, want)
    if variant != "default":  # the variant is live: its frequencies differ from the default rope
        x, pos = torch.zeros(1, 72, 32), torch.arange(72)[None]
        with torch.no_grad():
            cos = model.model.rotary_emb(x, pos)[0]
            plain = _with_rope("llama", ROPE_VARIANTS["default"]).model.rotary_emb(x, pos)[0]
        assert (plain - cos).abs().max() > 1e-2


def test_rope_qwen3_5_interleaved_multimodal_positions():
    """Qwen3.5: partial rotary with interleaved M-RoPE sections, positions [3, B, T] that differ per axis."""
    model = _with_rope("qwen3_5", {"mrope_interleaved": True, "mrope_section": [1, 1, 0]})
    ids = batch(t=9)
    t = torch.arange(9)
    pos = torch.stack([t, t // 3, t % 3])[:, None].expand(3, ids.shape[0], 9)
    with torch.no_grad():
        want = model(input_ids=ids, position_ids=pos).logits
        text_only = model(input_ids=ids).logits
        assert (text_only - want).abs().max() > 1e-4  # the multimodal positions are live
        report = tp.apply(model, ops=("rope",))
        assert "qwen3_5:apply_rotary_pos_emb" in report.swapped_names(), report
        got = model(input_ids=ids, position_ids=pos).logits
    _rope_close(got, want)


# -- returned outputs and activations ------------------------------------------------------------

@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_returned_outputs_unchanged(family):
    """hidden states, attention weights and router logits, patched (every op but the packing-aware
    attention, which like sdpa returns no attention weights) vs unpatched eager."""
    model = build(family).eval()
    ids = batch(t=6)
    kw = dict(input_ids=ids, output_hidden_states=True, output_attentions=True, output_router_logits=True)
    with torch.no_grad():
        want = model(**kw)
        report = tp.apply(model, ops=("norm", "rope", "swiglu", "experts"))
        assert {s.spec.op for s in report.swapped} >= {"rms_norm", "apply_rotary_pos_emb", "moe_experts"}, report
        got = model(**kw)
    atol, rtol = testing.tolerance(torch.float32, "moe_experts")
    for key in ("logits", "hidden_states", "attentions", "router_logits"):
        w, g = want[key], got[key]
        assert w is not None and g is not None, key
        w, g = (w,) if torch.is_tensor(w) else tuple(w), (g,) if torch.is_tensor(g) else tuple(g)
        assert len(g) == len(w) > 0, key
        for a, b in zip(g, w):
            torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_pytorch_tanh", "gelu_new", "relu", "gelu_fast"])
def test_activation_silu_patched_other_keeps_original(act, moe_calls):
    """SiLU and GELU (exact, tanh) MLPs and experts run the twinkle ops; another activation keeps
    transformers' forward (the report says why) and the logits are bit-identical to unpatched."""
    from test_patches_models import _cfg
    from transformers.models.qwen3_moe import modeling_qwen3_moe as hf
    cfg = _cfg("qwen3_moe")
    cfg.hidden_act = act
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = hf.Qwen3MoeForCausalLM(cfg).eval()
    ids = batch(t=6)
    with torch.no_grad():
        want = model(input_ids=ids).logits
        report = tp.apply(model, ops=("swiglu", "experts"))
        _reset(moe_calls)
        got = model(input_ids=ids).logits
    reasons = report.skipped_reasons()
    if act in ("silu", "gelu", "gelu_pytorch_tanh", "gelu_new"):
        assert moe_calls["moe_experts"] > 0
        assert {"qwen3_moe:Qwen3MoeMLP", "qwen3_moe:Qwen3MoeExperts"} <= set(report.swapped_names()), report
        atol, rtol = testing.tolerance(torch.float32, "moe_experts")
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    else:
        assert "the fused GLU does not compute" in reasons["qwen3_moe:Qwen3MoeMLP"], report
        assert "the fused GLU does not compute" in reasons["qwen3_moe:Qwen3MoeExperts"], report
        assert moe_calls["moe_experts"] == 0
        assert torch.equal(got, want)
