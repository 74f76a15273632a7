"""Packed (padding-free) batches through a patched model: each sample's logits and the parameter
gradients match the samples run one by one, in full-attention layers (the packing-aware attention)
and in Gated DeltaNet layers (cu_seqlens through the GDN ops)."""
from __future__ import annotations

import pytest
import torch
import transformers.models.qwen3.modeling_qwen3 as mq

import twinkle_patches as tp
from twinkle_kernels import testing

from test_patches_gdn_moe import gdn_ops  # noqa: F401  (fixture: contract stand-ins / real GDN ops)
from test_patches_models import VOCAB, assert_unpatched_mishandles_packing, batch, build

pytestmark = pytest.mark.filterwarnings("ignore")

LENGTHS = [5, 9, 3]


@pytest.fixture(autouse=True)
def _clean_patches():
    tp.revert()
    yield
    tp.revert()


def _kwargs(lengths, flash_style):
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    kw = dict(position_ids=torch.cat([torch.arange(n) for n in lengths])[None])
    if flash_style:  # what DataCollatorWithFlattening(return_flash_attn_kwargs=True) adds
        kw.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths))
    return kw, cu.tolist()


def _loss(logits, probe):
    return (logits.float() * probe[: logits.shape[1]]).sum()


def _packed_vs_alone(model, flash_style):
    ids = batch(t=sum(LENGTHS))[:1]
    kw, cu = _kwargs(LENGTHS, flash_style)
    probe = torch.randn(sum(LENGTHS), VOCAB, generator=torch.Generator().manual_seed(3))
    model.zero_grad(set_to_none=True)
    alone = []
    for a, b in zip(cu[:-1], cu[1:]):
        out = model(input_ids=ids[:, a:b]).logits
        _loss(out, probe[a:b]).backward()
        alone.append(out.detach())
    g_alone = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    packed = model(input_ids=ids, **kw).logits
    _loss(packed, probe).backward()
    g_packed = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return packed.detach(), torch.cat(alone, dim=1), g_packed, g_alone


def _assert_same(packed, alone, g_packed, g_alone, scale):
    atol, rtol = testing.tolerance(torch.float32, "chunk_gated_delta_rule")
    torch.testing.assert_close(packed, alone, atol=atol * scale, rtol=rtol * scale)
    assert g_packed.keys() == g_alone.keys()
    for n in g_alone:
        s = scale * max(1.0, float(g_alone[n].abs().max()))
        torch.testing.assert_close(g_packed[n], g_alone[n], atol=atol * s, rtol=rtol * scale, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("flash_style", [True, False], ids=["cu_seq_lens", "position_ids"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_qwen3_packed_samples_stay_independent(flash_style, attn):
    model = build("qwen3")
    model.set_attn_implementation(attn)
    packed, alone, _, _ = _packed_vs_alone(model, flash_style)
    leak = float((packed - alone).abs().max())
    assert leak > 1e-2, "unpatched transformers no longer mixes packed samples: this test needs a new baseline"
    before = mq.ALL_ATTENTION_FUNCTIONS
    report = tp.apply(model)
    assert "qwen3:ALL_ATTENTION_FUNCTIONS" in {s.spec.name for s in report.swapped if s.where == "module"}, report
    assert model.config._attn_implementation == attn  # the user's implementation is kept
    _assert_same(*_packed_vs_alone(model, flash_style), scale=10.0)
    tp.revert(report)
    assert model.config._attn_implementation == attn and mq.ALL_ATTENTION_FUNCTIONS is before


def test_qwen3_5_hybrid_packed_samples_stay_independent(gdn_ops):  # noqa: F811
    kind, calls = gdn_ops
    model = build("qwen3_5")  # layer 0 Gated DeltaNet, layer 1 full attention
    ids = batch(t=sum(LENGTHS))[:1]
    kw, cu = _kwargs(LENGTHS, True)
    with torch.no_grad():
        alone = torch.cat([model(input_ids=ids[:, a:b]).logits for a, b in zip(cu[:-1], cu[1:])], dim=1)
        assert_unpatched_mishandles_packing(lambda: model(input_ids=ids, **kw).logits, alone)
    with tp.patched(model):
        out = _packed_vs_alone(model, flash_style=True)
    assert calls.get("chunk_gated_delta_rule") and calls.get("causal_conv1d")
    _assert_same(*out, scale=10.0 if kind == "twinkle" else 1.0)


def test_qwen3_5_packed_prefill_with_cache(gdn_ops):  # noqa: F811
    """Eval with use_cache=True: the conv sees cache padding before the packed samples."""
    kind, calls = gdn_ops
    model = build("qwen3_5").eval()
    lengths = [1, 2]  # 3 tokens, shorter than the conv kernel (4): the cache pads the conv input on the left
    ids = batch(t=sum(lengths))[:1]
    kw, cu = _kwargs(lengths, True)
    with tp.patched(model), torch.no_grad():
        packed = model(input_ids=ids, use_cache=True, **kw).logits
        alone = torch.cat([model(input_ids=ids[:, a:b], use_cache=True).logits for a, b in zip(cu[:-1], cu[1:])], 1)
    atol, rtol = testing.tolerance(torch.float32, "chunk_gated_delta_rule")
    torch.testing.assert_close(packed, alone, atol=atol * 10, rtol=rtol * 10)


def test_model_built_after_apply_asks_for_packed_attention_by_name():
    from transformers import AutoModelForCausalLM
    from test_patches_models import _cfg
    tp.apply(families=["qwen3"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_cfg("qwen3"), attn_implementation="twinkle_packed")
    assert model.config._attn_implementation == "twinkle_packed"
    _assert_same(*_packed_vs_alone(model, flash_style=False), scale=10.0)
    tp.revert()
    from transformers.modeling_utils import AttentionInterface
    assert "twinkle_packed" not in AttentionInterface._global_mapping


def test_position_ids_changed_in_place_between_forwards_are_read_again():
    """The patched attention decides "packed or not" once per position_ids tensor (every layer of a
    forward passes the same one). A caller that refills one buffer in place between steps must get
    the new layout: plain positions first (one sample), then the same buffer packed, then plain again,
    each against a fresh tensor of the same values."""
    model = build("qwen3")
    ids = batch(t=sum(LENGTHS))[:1]
    packed_pos = _kwargs(LENGTHS, flash_style=False)[0]["position_ids"]
    plain_pos = torch.arange(sum(LENGTHS))[None]
    with tp.patched(model), torch.no_grad():
        buf = plain_pos.clone()
        out = [model(input_ids=ids, position_ids=buf).logits]
        buf.copy_(packed_pos)
        out.append(model(input_ids=ids, position_ids=buf).logits)
        buf.copy_(plain_pos)
        out.append(model(input_ids=ids, position_ids=buf).logits)
        fresh = [model(input_ids=ids, position_ids=p.clone()).logits for p in (plain_pos, packed_pos, plain_pos)]
    assert float((fresh[1] - fresh[0]).abs().max()) > 1e-2   # packing changes the result at all
    for got, want in zip(out, fresh):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
