"""Defaults that change training, against upstream Twinkle's Megatron backend and megatron-core
(issue 47; docs/upstream.md says which is which and why):

- ``set_optimizer("Adam")`` decays weights decoupled from the gradient, as megatron-core's Adam
  (``OptimizerConfig(optimizer="adam")``) and upstream do; ``decoupled_weight_decay=False`` is L2;
- ``set_lr_scheduler`` without ``max_lr`` peaks at the optimizer's lr (megatron-core's training
  loop passes ``max_lr=args.lr``; upstream's 1e-4 default ignores ``set_optimizer(lr=...)``);
- ``clip_grad_and_step(gradient_accumulation_steps=k)`` steps after calls k, 2k, ... (upstream's
  counter steps after calls k+1, 2k+1, ...: its first step takes one call more);
- ``save()`` writes under ``output/`` and copies the tokenizer of the model's folder.

One process, a tiny Qwen3 in fp32.
"""
import json
import os

import pytest
import torch

pytest.importorskip("megatron.core")


VOCAB = 256


def _model(tm, model_id=None, **opt):
    from twinkle_megatron.job.configs import tiny_qwen3_config
    m = tm.MegatronModel(model_id=model_id or tiny_qwen3_config(num_layers=1), mixed_precision="fp32", seed=5)
    if opt:
        m.set_optimizer(**opt)
    return m


def _batch(seed=0, rows=2):
    ids = torch.randint(0, VOCAB, (rows, 8), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def _weight(m):
    """A 2-D weight (weight decay applies to it; megatron exempts biases and norms)."""
    return next(p for n, p in m.unwrapped_chunks()[0].named_parameters() if p.dim() == 2 and "linear_fc1" in n)


def _one_step(m):
    p = _weight(m)
    before = p.detach().double().clone()
    m.forward_backward(inputs=_batch())
    m.clip_grad_and_step(max_grad_norm=None)
    return before, p.detach().double()


@pytest.mark.parametrize("decoupled", [True, False])
def test_adam_weight_decay_is_decoupled_as_megatron_unless_asked(tm, decoupled):
    """After Adam's first step each entry moves by lr * g / (|g| + eps) = lr * sign(g) (bias
    corrected): decoupled, p1 = p0 (1 - lr wd) - lr sign(g); L2, p1 = p0 - lr sign(g + wd p0).
    With wd large enough the two differ wherever wd p0 outweighs g."""
    lr, wd = 1e-2, 0.5
    kw = dict(optimizer_cls="Adam", lr=lr, weight_decay=wd, eps=1e-15)
    if not decoupled:
        kw["decoupled_weight_decay"] = False
    p0, p1 = _one_step(_model(tm, **kw))
    decayed = p0 * (1 - lr * wd) - p1      # decoupled: lr * sign(g)
    plain = p0 - p1                          # L2: lr * sign(g + wd p0)
    moved = decayed if decoupled else plain
    torch.testing.assert_close(moved.abs(), torch.full_like(moved, lr), atol=1e-7, rtol=1e-5)
    other = plain if decoupled else decayed
    assert float((other.abs() - lr).abs().max()) > 1e-5   # the other rule does not explain the step


def test_adam_and_adamw_are_the_same_optimizer(tm):
    a = _one_step(_model(tm, optimizer_cls="Adam", lr=1e-2, weight_decay=0.1))[1]
    b = _one_step(_model(tm, optimizer_cls="AdamW", lr=1e-2, weight_decay=0.1))[1]
    assert torch.equal(a, b)
    with pytest.raises(TypeError, match="decoupled_weight_decay must be a bool"):
        _model(tm, optimizer_cls="Adam", decoupled_weight_decay="yes")


def test_scheduler_peaks_at_the_optimizers_lr(tm):
    m = _model(tm, optimizer_cls="AdamW", lr=3e-3)
    m.set_lr_scheduler("default", lr_warmup_steps=2, lr_decay_steps=10)
    lrs = []
    for _ in range(3):
        m.forward_backward(inputs=_batch())
        m.clip_grad_and_step()
        lrs.append(m.optimizer.param_groups[0]["lr"])
    assert lrs[1] == pytest.approx(3e-3)   # the end of the warmup: megatron-core's max_lr=args.lr
    assert max(lrs) <= 3e-3 + 1e-12


def test_accumulation_steps_after_every_k_calls(tm):
    """k=2: calls 1, 3 return None, calls 2, 4 step; the first step equals one call with both
    batches (the same rows, token-mean over both), not three calls' worth as upstream's counter."""
    acc = _model(tm, optimizer_cls="AdamW", lr=1e-2)
    one = _model(tm, optimizer_cls="AdamW", lr=1e-2)
    out = []
    for call in range(4):
        acc.forward_backward(inputs=_batch(seed=call))
        out.append(acc.clip_grad_and_step(gradient_accumulation_steps=2))
        if call == 1:
            after_first = _weight(acc).detach().clone()
    assert [o is None for o in out] == [True, False, True, False]
    both = {k: torch.cat([_batch(seed=0)[k], _batch(seed=1)[k]]) for k in ("input_ids", "labels")}
    one.forward_backward(inputs=both)
    norm = one.clip_grad_and_step()
    assert out[1] == pytest.approx(norm, rel=1e-6)   # the same gradient: two calls, not three
    # Adam's first step is lr * g / (|g| + eps): entries with |g| near eps move by less than lr, so
    # they carry the summation order's rounding; 1% of an update
    torch.testing.assert_close(after_first, _weight(one).detach(), atol=1e-4, rtol=0)


def test_save_defaults_to_output_and_copies_the_tokenizer(tm, tmp_path, monkeypatch):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from twinkle_megatron.job.configs import tiny_qwen3_config
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(tiny_qwen3_config(num_layers=1)))
    vocab = {w: i for i, w in enumerate(["<unk>", "hello", "world", "twinkle"])}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>").save_pretrained(str(folder))
    m = _model(tm, model_id=str(folder))
    monkeypatch.chdir(tmp_path)
    path = m.save("ckpt")
    assert os.path.abspath(path) == str(tmp_path / "output" / "ckpt")
    assert os.path.isfile(os.path.join(path, "tokenizer.json"))
    tok = AutoTokenizer.from_pretrained(path)
    assert tok("hello twinkle world")["input_ids"] == [1, 3, 2]
    # the copied files are in the manifest, so a later load verifies them too
    manifest = json.load(open(os.path.join(path, "manifest.json")))
    assert "tokenizer.json" in manifest["files"]
    # a model built from a config dict has no folder: nothing to copy, the save still works
    plain = _model(tm).save("plain")
    assert not os.path.exists(os.path.join(plain, "tokenizer.json"))
