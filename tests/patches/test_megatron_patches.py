"""twinkle_patches.megatron: module-global swaps in megatron-core, exact revert, the report, and
the swapped functions computing what megatron's own do."""
import sys
import types

import pytest
import torch

pytest.importorskip("megatron.core")

from twinkle_patches import megatron as tpm  # noqa: E402


def _megatron_globals():
    return {n: dict(vars(m)) for n, m in sys.modules.items() if m is not None and n.startswith("megatron.")}


_CP = types.SimpleNamespace()  # megatron only asks for the CP group when none is passed


def _cfg(**kw):
    base = dict(rotary_interleaved=False, multi_latent_attention=False, apply_rope_fusion=False,
                mrope_section=None)
    base.update(kw)
    return types.SimpleNamespace(**base)


def test_apply_revert_is_exact_and_reported():
    import megatron.core.transformer.attention as attention
    import megatron.core.transformer.mlp as mlp
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.fusions import fused_bias_swiglu
    rope0, swiglu0 = rope_utils.apply_rotary_pos_emb, fused_bias_swiglu.bias_swiglu_impl
    before = _megatron_globals()
    report = tpm.apply()
    try:
        assert report.swapped_names() == [t.name for t in tpm.TARGETS]
        assert attention.apply_rotary_pos_emb is rope_utils.apply_rotary_pos_emb is not rope0
        assert attention.apply_rotary_pos_emb.__wrapped__ is rope0
        assert mlp.bias_swiglu_impl is fused_bias_swiglu.bias_swiglu_impl is not swiglu0
        text = str(report)
        assert "target=megatron" in text and "swapped=2" in text
        assert "megatron.core.transformer.attention.apply_rotary_pos_emb" in text  # an alias
        assert tpm.active() == sorted(t.name for t in tpm.TARGETS)
        again = tpm.apply()   # already swapped: skipped, nothing changes
        assert not again.swapped
        assert set(again.skipped_reasons().values()) == {"already swapped by an earlier apply()"}
        assert attention.apply_rotary_pos_emb.__wrapped__ is rope0
    finally:
        tpm.revert(report)
    assert report.reverted and "(reverted)" in str(report)
    assert tpm.active() == []
    assert attention.apply_rotary_pos_emb is rope0 and mlp.bias_swiglu_impl is swiglu0
    for n, saved in before.items():
        now = vars(sys.modules[n])
        changed = [k for k in saved if now.get(k, object()) is not saved[k]]
        assert not changed, f"{n}: not restored: {changed}"
    tpm.revert(report)  # idempotent


def test_select_ops_and_bad_names():
    report = tpm.apply(ops=("swiglu_packed",))
    try:
        assert report.swapped_names() == ["megatron.core.fusions.fused_bias_swiglu.bias_swiglu_impl"]
        assert "not selected" in next(iter(report.skipped_reasons().values()))
    finally:
        tpm.revert(report)
    with pytest.raises(ValueError, match="ops: unknown"):
        tpm.apply(ops=("nope",))
    bad = tpm.apply(backend="npu")   # not available on this machine: skipped with the reason
    try:
        assert not bad.swapped and all("npu" in r for r in bad.skipped_reasons().values())
    finally:
        tpm.revert(bad)


@pytest.mark.parametrize("rot", [16, 8])
def test_swapped_functions_match_megatron(rot):
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.fusions import fused_bias_swiglu
    s, b, h, d = 6, 2, 3, 16
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    f = torch.outer(torch.arange(s).float(), inv)
    freqs = torch.cat([f, f], -1)[:, None, None, :]
    t = torch.randn(s, b, h, d, requires_grad=True)
    x = torch.randn(5, 2, 24, requires_grad=True)
    bias = torch.randn(24)
    ref_rope = rope_utils.apply_rotary_pos_emb(t, freqs, _cfg(), cp_group=_CP)
    ref_glu = torch.nn.functional.silu((x + bias)[..., :12]) * (x + bias)[..., 12:]
    report = tpm.apply()
    try:
        out_rope = rope_utils.apply_rotary_pos_emb(t, freqs, _cfg(), cp_group=_CP)
        out_glu = fused_bias_swiglu.bias_swiglu_impl(x, bias)
        # unsupported layouts fall through to the original
        inter = rope_utils.apply_rotary_pos_emb(t, freqs, _cfg(rotary_interleaved=True), cp_group=_CP)
    finally:
        tpm.revert(report)
    torch.testing.assert_close(out_rope, ref_rope, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out_glu, ref_glu, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(inter, rope_utils.apply_rotary_pos_emb(t, freqs, _cfg(rotary_interleaved=True), cp_group=_CP))
    g = torch.randn_like(out_rope)
    (ga,) = torch.autograd.grad(out_rope, t, g)
    (gb,) = torch.autograd.grad(ref_rope, t, g)
    torch.testing.assert_close(ga, gb, rtol=1e-5, atol=1e-6)
