"""The training job's embedded tiny model configs (Hugging Face ``config.json`` dicts), so the job
runs with nothing downloaded: a Qwen3-style dense model and a Qwen3.5-style hybrid, both on the
byte vocabulary of :mod:`twinkle_megatron.job.data`."""
from __future__ import annotations

from . import data as train_data

# An embedded Qwen3-style config: byte vocabulary (train_data.VOCAB_SIZE) padded so that every
# tensor-parallel size up to 64 divides it (the extra ids are never produced by the tokenizer).
PADDED_VOCAB = ((train_data.VOCAB_SIZE + 63) // 64) * 64


def tiny_qwen3_config(num_layers: int = 4) -> dict:
    return {
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": PADDED_VOCAB,
        "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": num_layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "torch_dtype": "float32",
        "bos_token_id": train_data.BOS, "eos_token_id": train_data.EOS, "pad_token_id": train_data.PAD,
    }


def tiny_qwen3_5_config(num_layers: int = 4) -> dict:
    """The embedded Qwen3.5-style hybrid: Gated DeltaNet layers with a gated full-attention layer
    every 4th (transformers' default pattern), zero-centred norms, partial rotary 0.25."""
    return {
        "model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"], "vocab_size": PADDED_VOCAB,
        "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": num_layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 32,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": [2, 1, 1], "mrope_interleaved": True},
        "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": train_data.BOS, "eos_token_id": train_data.EOS, "pad_token_id": train_data.PAD,
    }
