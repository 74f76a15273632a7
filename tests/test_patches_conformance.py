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
