"""twinkle_megatron.models: the family registry and each family's HF <-> megatron name table, read
by the generic converter (no megatron process needed).

- every registered ``model_type`` has one family, and every family folder has the same files;
- a family's table names every tensor of the transformers model exactly once (so an export
  through the table is complete and a load reads nothing twice);
- for every entry, sharding with ``convert.from_hf`` over TP 1 and 2 and gathering back with
  ``convert.to_hf`` (the export direction of the same table) returns the HF tensors bit for bit,
  on random weights of tiny models of every family.
"""
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from twinkle_megatron import config, convert, models  # noqa: E402

from conftest import ROOT  # noqa: E402

COMMON = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              num_hidden_layers=2, max_position_embeddings=32, tie_word_embeddings=False)
HYBRID = dict(COMMON, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
              linear_num_key_heads=2, linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"])
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)


def _tiny(name):
    t = transformers
    if name == "llama":
        return t.LlamaForCausalLM(t.LlamaConfig(intermediate_size=48, **COMMON))
    if name == "qwen2":
        return t.Qwen2ForCausalLM(t.Qwen2Config(intermediate_size=48, **COMMON))
    if name == "qwen3":
        return t.Qwen3ForCausalLM(t.Qwen3Config(intermediate_size=48, **dict(COMMON, tie_word_embeddings=True)))
    if name == "qwen3_moe":
        return t.Qwen3MoeForCausalLM(t.Qwen3MoeConfig(intermediate_size=48, **COMMON, **MOE))
    if name == "mixtral":
        return t.MixtralForCausalLM(t.MixtralConfig(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
                                                    **COMMON))
    if name == "glm4_moe":
        return t.Glm4MoeForCausalLM(t.Glm4MoeConfig(
            intermediate_size=48, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
            n_shared_experts=1, first_k_dense_replace=1, attention_bias=True, use_qk_norm=True,
            **dict(COMMON, num_hidden_layers=3)))
    if name == "deepseek_v3":   # without a q latent (q_proj), 1 dense + 2 MoE layers
        return t.DeepseekV3ForCausalLM(t.DeepseekV3Config(
            intermediate_size=48, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
            n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=None,
            kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=4,
            **dict(COMMON, num_hidden_layers=3, num_key_value_heads=4)))
    if name == "qwen3_next":   # layer 0 dense
        return t.Qwen3NextForCausalLM(t.Qwen3NextConfig(
            intermediate_size=48, shared_expert_intermediate_size=24, mlp_only_layers=[0], **HYBRID, **MOE))
    if not hasattr(t, "Qwen3_5MoeForCausalLM"):
        pytest.skip("transformers has no Qwen3.5 models")
    if name == "qwen3_5_text":
        return t.Qwen3_5ForCausalLM(t.Qwen3_5TextConfig(intermediate_size=48, **HYBRID))
    return t.Qwen3_5MoeForCausalLM(t.Qwen3_5MoeTextConfig(shared_expert_intermediate_size=24, **HYBRID, **MOE))


NAMES = ["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "glm4_moe", "deepseek_v3", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"]


class _Weights:
    """A state dict read the way the converter reads a checkpoint (``in`` / ``get``)."""

    def __init__(self, tensors):
        self.tensors = tensors

    def __contains__(self, name):
        return name in self.tensors

    def get(self, name):
        return self.tensors[name]

    def get_row(self, name, index):
        return self.tensors[name][index]


@pytest.fixture(scope="module", params=NAMES)
def tiny(request):
    torch.manual_seed(0)
    model = _tiny(request.param)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return config.model_shape(model.config.to_dict()), sd


def _entries(shape):
    """``(entry, layer prefix or "", expert or -1)`` for every parameter of the model, experts expanded."""
    tables = convert.Tables(shape)
    out = [(e, "", -1) for e in tables.model.values()]
    for layer in range(shape.num_layers):
        prefix = convert.layer_prefix(shape, layer)
        for entry in tables.layer(layer).values():
            experts = range(shape.num_experts) if entry.expert else [-1]
            out += [(entry, prefix, e) for e in experts]
    return out


def test_registry_and_family_folders():
    assert len(models.MODEL_TYPES) == len(set(models.MODEL_TYPES))
    for t in models.MODEL_TYPES:
        assert t in models.family(t).model_types
    with pytest.raises(ValueError, match="model_type='gpt2' is not supported; supported: "):
        models.family("gpt2")
    base = os.path.join(ROOT, "twinkle_megatron", "models")
    folders = [d for d in sorted(os.listdir(base)) if os.path.isfile(os.path.join(base, d, "__init__.py"))]
    assert sorted(f.name for f in models.FAMILIES) == folders
    files = {d: sorted(f for f in os.listdir(os.path.join(base, d)) if f.endswith(".py")) for d in folders}
    assert len({tuple(v) for v in files.values()}) == 1, files


def test_table_names_every_hf_tensor_once(tiny):
    shape, sd = tiny
    named = []
    for entry, prefix, e in _entries(shape):
        if not entry.export:
            continue
        names = [prefix + h.format(e=e) if entry.expert else prefix + h for h in entry.hf]
        if entry.expert and not all(n in sd for n in names):
            names = [prefix + entry.fused] if e == 0 else []   # transformers' fused experts
        named += names
    assert len(named) == len(set(named))
    tied = {"lm_head.weight"} if shape.tie_word_embeddings else set()
    assert set(named) == set(sd) - tied


@pytest.mark.parametrize("tp", [1, 2])
def test_export_inverts_import_for_every_entry(tiny, tp):
    shape, sd = tiny
    weights = _Weights(sd)
    for entry, prefix, e in _entries(shape):
        parts = convert._read(weights, entry, prefix, e)
        shards = [convert.from_hf(entry, parts, shape, r, tp) for r in range(tp)]
        if entry.layout == "replicated":
            assert all(torch.equal(s, shards[0]) for s in shards)
            full = shards[0]
        else:
            full = torch.cat(shards, 1 if entry.layout == "row" else 0)
        back = convert.to_hf(entry, full, shape, tp)
        assert len(back) == len(parts), entry
        for b, p in zip(back, parts):
            assert torch.equal(b, p), (prefix, entry.hf, e)


def test_checkpoint_reads_one_expert_of_a_fused_tensor(tmp_path):
    """``HFCheckpoint.get_row`` (what the loader reads a routed expert of transformers' fused
    ``[E, ...]`` tensors with) gives that expert's rows, the same as the whole tensor indexed.
    The file holds the model's state dict as it is in memory (fused); ``save_pretrained`` would
    write per-expert names."""
    from safetensors.torch import save_file
    torch.manual_seed(0)
    model = _tiny("qwen3_moe")
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(sd, os.path.join(tmp_path, "model.safetensors"))
    shape = config.model_shape(model.config.to_dict())
    ckpt = convert.HFCheckpoint(str(tmp_path))
    fused = [n for n in sd if n.endswith("mlp.experts.gate_up_proj") or n.endswith("mlp.experts.down_proj")]
    assert fused, "transformers' state dict has no fused experts"
    for name in fused:
        for e in range(sd[name].shape[0]):
            assert torch.equal(ckpt.get_row(name, e), sd[name][e]), (name, e)
        with pytest.raises(IndexError, match=f"row {sd[name].shape[0]} asked"):
            ckpt.get_row(name, sd[name].shape[0])
    with pytest.raises(KeyError, match="missing"):
        ckpt.get_row("model.layers.0.mlp.experts.nothing", 0)
    for entry, prefix, e in _entries(shape):   # the loader's reads, from the file and in memory
        for a, b in zip(convert._read(ckpt, entry, prefix, e), convert._read(_Weights(sd), entry, prefix, e)):
            assert torch.equal(a, b), (prefix, entry.hf, e)


def test_rows_of_fused_projections_follow_the_table(tiny):
    """``hf_rows`` (what LoRA sizes its targets by) adds up to the fused parameter's rows."""
    shape, sd = tiny
    weights = _Weights(sd)
    for entry, prefix, e in _entries(shape):
        if entry.layout in ("qkv", "gated_qkv", "sections"):
            parts = convert._read(weights, entry, prefix, e)
            rows = sum(p.shape[0] for p in parts)
            assert convert.hf_rows(entry, shape, rows) == [p.shape[0] for p in parts], entry.hf
