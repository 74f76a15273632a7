"""Padding is never mistaken for packing.

A padded batch with ``position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)`` (what generate and
many collators pass) repeats a position across mid-row padding. Patched models must treat every row as
one sample there, exactly as the unpatched model does: left, right and mid-row padding, forward and
backward, every registered family (the hybrids' recurrent layers included), and greedy generate with
dynamic and static caches. Packed rows (positions restarting at 0, no padding mask) stay packed; a
padding mask with positions that restart at 0 after a real token is refused naming both.
"""
from __future__ import annotations

import pytest
import torch

import twinkle_patches as tp
from twinkle_kernels import testing

from test_patches_models import FAMILY_NAMES, batch, build

pytestmark = [pytest.mark.filterwarnings("ignore"), pytest.mark.timeout(300)]

T = 12


@pytest.fixture(autouse=True)
def _clean_patches():
    tp.revert()
    yield
    tp.revert()


def _mask(kind: str) -> torch.Tensor:
    """[2, T] attention mask: row 0 padded as ``kind``, row 1 unpadded."""
    m = torch.ones(2, T, dtype=torch.long)
    if kind == "left":
        m[0, :4] = 0
    elif kind == "right":
        m[0, -4:] = 0
    elif kind == "mid":
        m[0, 4:7] = 0
    else:
        raise ValueError(kind)
    return m


def _run(model, ids, mask):
    """Logits at the real tokens and every parameter's gradient of a loss over the real tokens."""
    model.zero_grad(set_to_none=True)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)
    real = mask.bool()
    logits = out.logits[real]
    (logits.float().square().mean()).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def _assert_same(got, want, what):
    atol, rtol = testing.tolerance(torch.float32)
    scale = 20  # sums over layers of fused ops, each within the fp32 bar
    torch.testing.assert_close(got[0], want[0], atol=atol * scale, rtol=rtol * scale, msg=lambda m: f"{what} logits: {m}")
    assert got[1].keys() == want[1].keys()
    for n in want[1]:
        torch.testing.assert_close(got[1][n], want[1][n], atol=atol * scale, rtol=rtol * scale,
                                   msg=lambda m: f"{what} grad {n}: {m}")


@pytest.mark.parametrize("kind", ["left", "right", "mid"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_padded_rows_equal_unpatched(family, kind, attn):
    model = build(family)
    model.set_attn_implementation(attn)
    ids, mask = batch(t=T), _mask(kind)
    want = _run(model, ids, mask)
    tp.apply(model)
    got = _run(model, ids, mask)
    _assert_same(got, want, f"{family} {attn} {kind}-padded")


def test_packed_rows_stay_packed():
    """Positions restarting at 0 with no padding mask: each sample attends only to itself (the row
    equals the samples run one at a time), so the packing rule did not become 'never packed'."""
    model = build("qwen3")
    model.set_attn_implementation("sdpa")
    tp.apply(model)
    ids = batch(b=1, t=T)
    pos = torch.cat([torch.arange(5), torch.arange(7)])[None]
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        first = model(input_ids=ids[:, :5], use_cache=False).logits
        second = model(input_ids=ids[:, 5:], use_cache=False).logits
    torch.testing.assert_close(packed, torch.cat([first, second], 1), atol=1e-5, rtol=1e-4)


def test_padding_with_restarting_positions_is_refused():
    model = build("qwen3")
    model.set_attn_implementation("sdpa")
    tp.apply(model)
    ids = batch(t=T)
    mask = _mask("right")
    pos = torch.cat([torch.arange(4), torch.arange(T - 4)]).expand(2, T)  # row 0: packed 4 + 4, then 4 pads
    with pytest.raises(ValueError, match="attention_mask and position_ids disagree"):
        model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_greedy_generate_with_left_padding_equals_unpatched(family, cache):
    try:
        model = build(family)
    except Exception as e:  # pragma: no cover - a family this transformers lacks
        pytest.skip(str(e))
    model.set_attn_implementation("sdpa")
    model.eval()
    ids, mask = batch(t=8), torch.ones(2, 8, dtype=torch.long)
    mask[0, :3] = 0
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    if cache == "static":
        if family == "qwen3_5":
            pytest.skip("transformers' hybrid cache has no static variant")
        kw["cache_implementation"] = "static"
    with torch.no_grad():
        want = model.generate(ids, **kw)
        tp.apply(model)
        got = model.generate(ids, **kw)
    assert torch.equal(got, want), (got, want)


HYBRIDS = [f for f in FAMILY_NAMES if f in ("qwen3_next", "qwen3_5", "qwen3_5_moe")]


def _continued(model, ids, mask, split):
    """A padded prompt's forward with a cache, then the rest of the rows continued on that cache
    (transformers' ``test_recurrent_layers_mask_padding_on_continued_forward``): logits at the real
    tokens of both forwards."""
    pos = (mask.cumsum(-1) - 1).clamp(min=0)   # as generate computes them
    with torch.no_grad():
        first = model(input_ids=ids[:, :split], attention_mask=mask[:, :split], position_ids=pos[:, :split],
                      use_cache=True)
        second = model(input_ids=ids[:, split:], attention_mask=mask, position_ids=pos[:, split:],
                       past_key_values=first.past_key_values, use_cache=True)
    real = mask.bool()
    return first.logits[real[:, :split]], second.logits[real[:, split:]]


@pytest.mark.parametrize("kind", ["left", "mid"])
@pytest.mark.parametrize("family", HYBRIDS)
def test_padded_continued_forward_of_hybrids_equals_unpatched(family, kind):
    """The hybrids' recurrent state (Gated DeltaNet, conv) carried in the cache from a padded
    prompt into the continued forward: the patched model's logits equal the unpatched ones."""
    model = build(family).eval()
    model.set_attn_implementation("sdpa")
    ids, mask = batch(t=T), _mask(kind)
    want = _continued(model, ids, mask, split=9)
    tp.apply(model)
    got = _continued(model, ids, mask, split=9)
    atol, rtol = testing.tolerance(torch.float32, "chunk_gated_delta_rule")
    for g, w, what in zip(got, want, ("prompt", "continued")):
        torch.testing.assert_close(g, w, atol=atol * 20, rtol=rtol * 20, msg=lambda m: f"{family} {kind} {what}: {m}")
