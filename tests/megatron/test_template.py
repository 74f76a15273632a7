"""Conversations as inputs (upstream Twinkle's ``set_template`` and ``messages``): encoded with the
tokenizer's own chat template, labels on the assistant turns only. Checked against transformers'
``apply_chat_template`` (its ``return_assistant_tokens_mask`` on a template with generation
markers, an independent way to find the assistant tokens), then through the facade: a step on
``messages`` equals the step on the tokens transformers produced. Tiny local tokenizer, no hub."""
import json
import math

import pytest
import torch

pytest.importorskip("megatron.core")


WORDS = ["<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system", "hello", "world", "hi", "there",
         "how", "are", "you", "fine", "thanks", "be", "brief", "\n"]
# ChatML with transformers' generation markers around what the assistant writes
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
          "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>"
          "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONVERSATIONS = [
    [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "hi there"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "how are you"},
     {"role": "assistant", "content": "fine thanks"}, {"role": "user", "content": "hello"},
     {"role": "assistant", "content": "hi"}],
]


def _tokenizer(template=CHATML):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="removed")
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>",
                                  additional_special_tokens=["<|im_start|>", "<|im_end|>", "\n"])
    tok.chat_template = template
    return tok


def _transformers(tok, conversation):
    out = tok.apply_chat_template(conversation, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids = list(out["input_ids"])
    return ids, [i if m else -100 for i, m in zip(ids, out["assistant_masks"])]


@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["one_turn", "system_two_turns"])
def test_encoding_equals_transformers_assistant_mask(conversation):
    from twinkle_megatron.template import ChatTemplate
    tok = _tokenizer()
    got = ChatTemplate(tok).encode(conversation)
    ids, labels = _transformers(tok, conversation)
    assert got == {"input_ids": ids, "labels": labels}
    # each assistant turn: its words and <|im_end|>
    assert sum(label != -100 for label in labels) == sum(len(m["content"].split()) + 1 for m in conversation
                                                         if m["role"] == "assistant")


def test_bad_conversations_and_templates_are_refused():
    from twinkle_megatron.template import ChatTemplate
    chat = ChatTemplate(_tokenizer())
    with pytest.raises(ValueError, match="no assistant turn"):
        chat.encode([{"role": "user", "content": "hello"}])
    with pytest.raises(ValueError, match=r"messages\[0\]\['role'\] must be one of"):
        chat.encode([{"role": "robot", "content": "hello"}])
    with pytest.raises(ValueError, match="non-empty list"):
        chat.encode("hello")
    # a template that rewrites earlier turns (here: only the last assistant turn is shown in full)
    rewriting = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' and not loop.last %}"
                 "hi<|im_end|>{% else %}{{ m['content'] }}<|im_end|>{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(ValueError, match=r"messages\[2\]: this chat template does not encode"):
        ChatTemplate(_tokenizer(rewriting)).encode(CONVERSATIONS[1])
    with pytest.raises(ValueError, match="no chat_template"):
        ChatTemplate(_tokenizer(None))
    with pytest.raises(TypeError, match="needs a Hugging Face tokenizer"):
        ChatTemplate("chatml")


def _model(tm, folder):
    m = tm.MegatronModel(model_id=folder, mixed_precision="fp32", seed=3)
    m.set_optimizer("AdamW", lr=1e-2)
    return m


def test_messages_train_as_the_tokens_transformers_makes(tm, tmp_path):
    """set_template() from the model's folder; a step on messages equals the step on the
    transformers-encoded samples (loss, grad norm, logps), samples or a dict of conversations."""
    from twinkle_megatron.job.configs import tiny_qwen3_config
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(tiny_qwen3_config(num_layers=1)))
    tok = _tokenizer()
    tok.save_pretrained(str(folder))
    tokens = []
    for c in CONVERSATIONS:
        ids, labels = _transformers(tok, c)
        tokens.append({"input_ids": ids, "labels": labels})
    a, b, c = _model(tm, str(folder)), _model(tm, str(folder)), _model(tm, str(folder))
    with pytest.raises(ValueError, match="call set_template"):
        a.forward_backward(inputs=[{"messages": conv} for conv in CONVERSATIONS])
    a.set_template()
    c.set_template(str(folder))
    out_a = a.forward_backward(inputs=[{"messages": conv} for conv in CONVERSATIONS], return_logps=True)
    out_b = b.forward_backward(inputs=tokens, return_logps=True)
    out_c = c.forward_backward(inputs={"messages": CONVERSATIONS}, return_logps=True)
    assert out_a["loss"] == out_b["loss"] == out_c["loss"]
    assert torch.equal(out_a["logps"], out_b["logps"])
    assert a.clip_grad_and_step() == b.clip_grad_and_step() == c.clip_grad_and_step()
    fo = a.forward_only(inputs=[{"messages": conv} for conv in CONVERSATIONS])
    assert torch.equal(fo["logps"], b.forward_only(inputs=tokens)["logps"])
    with pytest.raises(ValueError, match="no assistant turn"):
        a.forward_backward(inputs=[{"messages": [{"role": "user", "content": "hello"}]}])
    assert a.calculate_metric()["step"] == 1   # the refused call counted nothing


# ---- set_processor(padding_free=True) ---------------------------------------------------------

LENGTHS = [5, 9, 3, 7]


def _samples(seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in LENGTHS:
        ids = torch.randint(0, 256, (n,), generator=g)
        labels = ids.clone()
        labels[:2] = -100                     # a prompt
        out.append({"input_ids": ids, "labels": labels})
    return out


def _tiny(tm, padding_free, loss="cross_entropy", **loss_kw):
    from twinkle_megatron.job.configs import tiny_qwen3_config
    m = tm.MegatronModel(model_id=tiny_qwen3_config(num_layers=1), mixed_precision="fp32", seed=3)
    m.set_optimizer("AdamW", lr=1e-2)
    m.set_loss(loss, **loss_kw)
    m.set_processor(padding_free=padding_free)
    return m


@pytest.mark.parametrize("loss, loss_kw, args", [
    ("cross_entropy", {}, {}),
    ("grpo", {"beta": 0.1}, {"advantages": [1.0, -0.5, 0.25, 2.0], "old": True, "ref": True}),
    ("dpo", {"beta": 0.5}, {"ref": True}),
], ids=["ce", "grpo", "dpo"])
def test_padding_free_equals_padded_rows(tm, loss, loss_kw, args):
    """One packed row of the four samples trains as the four padded rows: the same loss and
    grad norm (different shapes, so to fp32 rounding) and the same log-probs at every sample token;
    [B] arguments follow their samples, [B, S] ones give each sample's first positions."""
    g = torch.Generator().manual_seed(7)
    kw = {}
    if "advantages" in args:
        kw["advantages"] = torch.tensor(args["advantages"])
    for name in ("old", "ref"):
        if args.get(name):
            kw[f"{name}_logps"] = -torch.rand(len(LENGTHS), max(LENGTHS), generator=g) - 2
    packed, padded = _tiny(tm, True, loss, **loss_kw), _tiny(tm, False, loss, **loss_kw)
    a = packed.forward_backward(inputs=_samples(), return_logps=True, **kw)
    b = padded.forward_backward(inputs=_samples(), return_logps=True, **kw)
    assert a["logps"].shape == (1, sum(LENGTHS)) and b["logps"].shape == (len(LENGTHS), max(LENGTHS))
    unpacked = torch.cat([b["logps"][i, :n] for i, n in enumerate(LENGTHS)])
    torch.testing.assert_close(a["logps"][0], unpacked, atol=1e-5, rtol=1e-5)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    assert packed.clip_grad_and_step() == pytest.approx(padded.clip_grad_and_step(), rel=1e-5)


def test_padding_free_refusals(tm):
    m = _tiny(tm, True, "grpo")
    with pytest.raises(ValueError, match="padding_free: advantages must have one entry per sample"):
        m.forward_backward(inputs=_samples(), advantages=torch.ones(3))
    with pytest.raises(ValueError, match="padding_free: inputs\\[0\\] has position_ids"):
        m.forward_backward(inputs=[dict(s, position_ids=torch.arange(len(s["input_ids"]))) for s in _samples()],
                           advantages=torch.ones(4))
    with pytest.raises(TypeError, match="processor='Qwen3Processor' is not supported"):
        m.set_processor("Qwen3Processor")
    assert math.isfinite(m.forward_backward(inputs=_samples(), advantages=torch.ones(4))["loss"])
