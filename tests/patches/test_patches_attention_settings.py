"""A patched model keeps the attention settings its user chose.

transformers' own model tests check these (``test_attention_outputs``,
``test_retain_grad_hidden_states_attentions``, ``test_can_set_attention_dynamically``,
``test_sdpa_can_dispatch_non_composite_models``); here the same properties, for every registered
family, on a model patched by ``twinkle_patches.apply``:

- ``config._attn_implementation`` reads what the user set, while patched and after revert;
- ``config.output_attentions = True`` works on an eager model and returns the weights unpatched eager
  returns (bit for bit with only the attention patched), with gradients that can be retained; on an
  sdpa model it is refused exactly as unpatched;
- ``set_attn_implementation`` after patching switches the model, and packed samples stay apart under
  both implementations;
- the modeling module's interface is the very object it was after revert.
"""
from __future__ import annotations

import importlib

import pytest
import torch

import twinkle_patches as tp
from twinkle_kernels import testing

from test_patches_models import FAMILY_NAMES, VOCAB, batch, build

pytestmark = [pytest.mark.filterwarnings("ignore"), pytest.mark.timeout(300)]

LENGTHS = [5, 4, 3]


@pytest.fixture(autouse=True)
def _clean_patches():
    tp.revert()
    yield
    tp.revert()


def _module(family):
    return importlib.import_module(f"transformers.models.{family}.modeling_{family}")


def _attention_layers(model) -> int:
    kinds = getattr(model.config, "layer_types", None)
    return model.config.num_hidden_layers if kinds is None else sum(k == "full_attention" for k in kinds)


def _packed(model):
    """Logits of three samples packed in one row and of each sample alone. Hybrid models get the
    flash-style lengths too (their Gated DeltaNet layers split on ``cu_seq_lens_q``)."""
    ids = batch(t=sum(LENGTHS))[:1]
    kw = dict(position_ids=torch.cat([torch.arange(n) for n in LENGTHS])[None])
    cu = [0] + torch.tensor(LENGTHS).cumsum(0).tolist()
    if _attention_layers(model) < model.config.num_hidden_layers:
        c = torch.tensor(cu, dtype=torch.int32)
        kw.update(cu_seq_lens_q=c, cu_seq_lens_k=c, max_length_q=max(LENGTHS), max_length_k=max(LENGTHS))
    with torch.no_grad():
        packed = model(input_ids=ids, **kw).logits
        alone = torch.cat([model(input_ids=ids[:, a:b]).logits for a, b in zip(cu[:-1], cu[1:])], 1)
    return packed, alone


def _assert_packed_apart(model, scale=10.0):
    packed, alone = _packed(model)
    atol, rtol = testing.tolerance(torch.float32, "chunk_gated_delta_rule")
    torch.testing.assert_close(packed, alone, atol=atol * scale, rtol=rtol * scale)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_output_attentions_by_config_on_a_patched_eager_model(family):
    model = build(family).eval()  # eager
    ids = batch(t=7)
    model.config.output_attentions = True
    with torch.no_grad():
        want = model(input_ids=ids)
    mod = _module(family)
    before = mod.ALL_ATTENTION_FUNCTIONS
    report = tp.apply(model, ops=("packed_attention",))
    assert f"{family}:ALL_ATTENTION_FUNCTIONS" in {s.spec.name for s in report.swapped}, report
    assert model.config._attn_implementation == "eager"
    with torch.no_grad():
        got = model(input_ids=ids)
    n = _attention_layers(model)
    assert len(got.attentions) == len(want.attentions) == n and n > 0
    for g, w in zip(got.attentions, want.attentions):
        assert g is not None and torch.equal(g, w)
    assert torch.equal(got.logits, want.logits)
    # set before or after patching, the config's flag and the call's kwarg both return them
    model.config.output_attentions = False
    with torch.no_grad():
        assert model(input_ids=ids).attentions is None
        assert len(model(input_ids=ids, output_attentions=True).attentions) == n
    model.config.output_attentions = True
    with torch.no_grad():
        assert len(model(input_ids=ids).attentions) == n
    tp.revert(report)
    assert mod.ALL_ATTENTION_FUNCTIONS is before and model.config._attn_implementation == "eager"


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_attentions_retain_grad_on_a_patched_model(family):
    model = build(family)
    tp.apply(model)
    out = model(input_ids=batch(t=6), output_attentions=True, output_hidden_states=True)
    out.attentions[0].retain_grad()
    out.hidden_states[0].retain_grad()
    out.logits.float().square().mean().backward()
    assert out.attentions[0].grad is not None and out.hidden_states[0].grad is not None
    assert float(out.attentions[0].grad.abs().sum()) > 0


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_set_attn_implementation_after_patching(family):
    model = build(family).eval()
    model.set_attn_implementation("sdpa")
    ids = batch(t=7)
    with torch.no_grad():
        want_sdpa = model(input_ids=ids).logits
        model.set_attn_implementation("eager")
        want_eager = model(input_ids=ids).logits
        model.set_attn_implementation("sdpa")
    tp.apply(model)
    assert model.config._attn_implementation == "sdpa"
    atol, rtol = testing.tolerance(torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, want_sdpa, atol=atol * 10, rtol=rtol * 10)
    _assert_packed_apart(model)
    # an sdpa model refuses output_attentions in its config, patched or not (transformers' own check)
    with pytest.raises(ValueError, match="output_attentions"):
        model.config.output_attentions = True
    model.set_attn_implementation("eager")
    assert model.config._attn_implementation == "eager"
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, want_eager, atol=atol * 10, rtol=rtol * 10)
        assert len(model(input_ids=ids, output_attentions=True).attentions) == _attention_layers(model)
    _assert_packed_apart(model)
    tp.revert()
    assert model.config._attn_implementation == "eager"


def test_sdpa_model_returns_no_weights_as_unpatched():
    """``output_attentions=True`` in the call of an sdpa model: transformers returns no weights (and
    warns); the patched model does the same rather than switching implementation behind the user."""
    model = build("qwen3").eval()
    model.set_attn_implementation("sdpa")
    ids = batch(t=6)
    with torch.no_grad():
        want = model(input_ids=ids, output_attentions=True)
        tp.apply(model, ops=("packed_attention",))
        got = model(input_ids=ids, output_attentions=True)
    assert got.attentions == want.attentions == ()
    assert torch.equal(got.logits, want.logits)


def test_model_built_while_patched_keeps_its_implementation():
    from transformers import AutoModelForCausalLM
    from test_patches_models import _cfg
    tp.apply(families=["qwen3"])
    for impl in ("sdpa", "eager"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_cfg("qwen3"), attn_implementation=impl).eval()
        assert model.config._attn_implementation == impl
        _assert_packed_apart(model)


def test_other_implementations_are_reported_and_left_alone():
    from transformers.modeling_utils import AttentionInterface
    calls = []

    def mine(module, query, key, value, attention_mask, **kwargs):
        calls.append(query.shape)
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("user_attention", mine)
    try:
        model = build("qwen3").eval()
        model.set_attn_implementation("user_attention")
        report = tp.apply(model)
        assert "runs as is" in report.skipped_reasons()["qwen3:ALL_ATTENTION_FUNCTIONS"]
        assert model.config._attn_implementation == "user_attention"
        with torch.no_grad():
            model(input_ids=batch(t=5))
        assert len(calls) == 2  # the user's implementation, once per layer, through the family's interface
    finally:
        AttentionInterface._global_mapping.pop("user_attention", None)


def test_a_foreign_interface_is_reported_and_kept():
    mod = _module("qwen3")
    from transformers.modeling_utils import AttentionInterface
    theirs = AttentionInterface()
    real = mod.ALL_ATTENTION_FUNCTIONS
    mod.ALL_ATTENTION_FUNCTIONS = theirs
    try:
        report = tp.apply(families=["qwen3"], ops=("packed_attention",))
        assert "another library" in report.skipped_reasons()["qwen3:ALL_ATTENTION_FUNCTIONS"]
        assert mod.ALL_ATTENTION_FUNCTIONS is theirs
        tp.revert(report)
        assert mod.ALL_ATTENTION_FUNCTIONS is theirs
    finally:
        mod.ALL_ATTENTION_FUNCTIONS = real


def test_a_bidirectional_layer_is_not_split():
    """A non-causal attention (a vision tower's blocks share the modeling module) runs transformers'
    call unchanged, even with position ids that restart."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from twinkle_patches import _attention
    iface = _attention.family_interface(ALL_ATTENTION_FUNCTIONS, _module("qwen3").eager_attention_forward)

    class Layer(torch.nn.Module):
        is_causal = False
        num_key_value_groups = 1

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=g) for _ in range(3))
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]])
    want = sdpa_attention_forward(Layer(), q, k, v, None, scaling=0.3, position_ids=pos, is_causal=False)[0]
    got = iface["sdpa"](Layer(), q, k, v, None, scaling=0.3, position_ids=pos, is_causal=False)[0]
    assert torch.equal(got, want)
    assert set(iface) >= {"sdpa", "eager", "flash_attention_2"} and iface["flash_attention_2"] is \
        ALL_ATTENTION_FUNCTIONS["flash_attention_2"]
