"""The ``fused_linear_cross_entropy`` patch of ``*ForCausalLM``: a patched training step gives the
unpatched model's loss and gradients (transformers' own loss: shift, ignore_index,
num_items_in_batch), returns ``logits=None``, and revert restores the original forward."""
import pytest
import torch

import twinkle_patches as tp
from test_patches_models import VOCAB, build

FAMILIES = ("qwen3", "qwen3_moe", "qwen3_5")


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 9), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100          # a prompt that is not trained on
    labels[1, -2:] = -100
    return ids, labels


def _step(model, **kw):
    model.zero_grad(set_to_none=True)
    out = model(**kw)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def _compare(ref, got):
    (out_r, g_r), (out_g, g_g) = ref, got
    torch.testing.assert_close(out_g.loss, out_r.loss, rtol=1e-5, atol=1e-6)
    assert set(g_g) == set(g_r)
    for n in g_r:
        torch.testing.assert_close(g_g[n], g_r[n], rtol=1e-4, atol=1e-6, msg=lambda m: f"grad of {n}: {m}")


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_training_step_matches(family):
    model = build(family)
    model.train()
    cls, orig_forward = type(model), type(model).forward
    ids, labels = _batch()
    ref = _step(model, input_ids=ids, labels=labels)
    ref_n = _step(model, input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(11))
    assert ref[0].logits is not None

    report = tp.apply(model, ops=("fused_linear_cross_entropy",), backend="cpu")
    try:
        assert any(s.spec.op == "fused_linear_cross_entropy" for s in report.swapped), str(report)
        assert type(model) is not cls and type(model).forward is not orig_forward
        got = _step(model, input_ids=ids, labels=labels)
        assert got[0].logits is None
        _compare(ref, got)
        _compare(ref_n, _step(model, input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(11)))
        # return_dict=False: a tuple without the (absent) logits, the loss first
        tup = model(input_ids=ids, labels=labels, return_dict=False)
        assert isinstance(tup, tuple) and torch.allclose(tup[0], ref[0].loss, rtol=1e-5)
        # evaluation and label-free calls keep their logits
        model.eval()
        with torch.no_grad():
            ev = model(input_ids=ids, labels=labels)
        assert ev.logits is not None and ev.logits.shape == (2, 9, VOCAB)
        model.train()
    finally:
        tp.revert(report)
    assert type(model) is cls and cls.forward is orig_forward
    again = _step(model, input_ids=ids, labels=labels)
    assert again[0].logits is not None
    _compare(ref, again)


def test_not_applied_by_default_and_wrapped_head_falls_back():
    model = build("qwen3")
    report = tp.apply(model, backend="cpu")
    try:
        assert not any(s.spec.op == "fused_linear_cross_entropy" for s in report.swapped)
    finally:
        tp.revert(report)
    # an lm_head with a hook (an adapter, a probe) is left alone
    model.lm_head.register_forward_hook(lambda *a: None)
    report = tp.apply(model, ops=("linear_ce",), backend="cpu")
    try:
        assert type(model).__name__ == "Qwen3ForCausalLM"
        assert any("lm_head has forward hooks" in s.reason for s in report.skipped), str(report)
        ids, labels = _batch()
        model.train()
        assert model(input_ids=ids, labels=labels).logits is not None
    finally:
        tp.revert(report)
