"""Conversations as inputs (upstream Twinkle's ``set_template`` and ``messages``): encoded with the
tokenizer's own chat template, labels on the assistant turns only. Checked against transformers'
``apply_chat_template`` (its ``return_assistant_tokens_mask`` on a template with generation
markers, an independent way to find the assistant tokens), then through the facade: a step on
``messages`` equals the step on the tokens transformers produced. Tiny local tokenizer, no hub."""
import json

import pytest
import torch

pytest.importorskip("megatron.core")

from conftest import megatron_one_rank  # noqa: E402

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


@pytest.fixture(scope="module")
def tm():
    with megatron_one_rank() as tm:
        yield tm


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
