"""Issue 47: ``load(adapter_dir, adapter_name=)`` of a weights-only adapter folder written by peft
itself (``PeftModel.save_pretrained``: adapter_config.json + adapter_model.safetensors, nothing
of this package) loads it into the named adapter, with upstream's call form
(``load(name, output_dir=parent, adapter_name=)``). The adapter's logits then equal the peft
model's on transformers, the other adapter is untouched, and the loaded adapter trains."""
import pytest
import torch

pytest.importorskip("megatron.core")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


VOCAB, SEQ = 128, 12
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj"]}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft_load")
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
        max_position_embeddings=64, head_dim=16, tie_word_embeddings=False, intermediate_size=128,
        num_hidden_layers=2))
    hf.save_pretrained(str(root / "base"))
    torch.manual_seed(1)   # init_lora_weights=False: both factors random, the adapter changes the logits
    pm = peft.get_peft_model(hf, peft.LoraConfig(**LORA, init_lora_weights=False))
    pm.save_pretrained(str(root / "adapters"))   # -> adapters/adapter_config.json, adapter_model.safetensors
    pm.eval()
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        theirs = pm(input_ids=ids).logits
        base = pm.get_base_model()
        with pm.disable_adapter():
            plain = base(input_ids=ids).logits
    assert float((theirs - plain).abs().max()) > 1e-2
    return {"root": root, "ids": ids, "peft_logits": theirs}


def test_peft_folder_loads_into_the_named_adapter(tm, folders):
    root, ids = folders["root"], folders["ids"]
    model = tm.MegatronModel(str(root / "base"), mixed_precision="fp32")
    for name in ("a", "b"):
        model.add_adapter_to_model(name, dict(LORA, init_lora_weights=False))
        model.set_optimizer("AdamW", lr=1e-2, adapter_name=name)
    a_before = model.logits(ids, adapter_name="a")
    b_before = model.logits(ids, adapter_name="b")
    model.load("adapters", output_dir=str(root), adapter_name="b")      # upstream's call form
    mine = model.logits(ids, adapter_name="b")
    diff = float((mine - folders["peft_logits"]).abs().max())
    print(f"[loaded adapter vs peft: logits max diff {diff:.1e}]")
    assert diff < 1e-5 and float((b_before - folders["peft_logits"]).abs().max()) > 1e-2
    assert torch.equal(model.logits(ids, adapter_name="a"), a_before)
    # it trains from there: one step moves its logits, and only its
    out = model.forward_backward(inputs={"input_ids": ids, "labels": ids}, adapter_name="b")
    assert out["loss"] > 0 and model.clip_grad_and_step(adapter_name="b") > 0
    assert not torch.equal(model.logits(ids, adapter_name="b"), mine)
    assert torch.equal(model.logits(ids, adapter_name="a"), a_before)
