"""Patch a Hugging Face model with twinkle ops, check the logits, revert.

Run from the repository root: ``python examples/hf_patch.py`` (works installed or from a plain checkout).
"""
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
if importlib.util.find_spec("twinkle_patches") is None:  # plain checkout: the folder patches/ is the package
    _spec = importlib.util.spec_from_file_location("twinkle_patches", os.path.join(ROOT, "patches", "__init__.py"),
                                                   submodule_search_locations=[os.path.join(ROOT, "patches")])
    sys.modules["twinkle_patches"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["twinkle_patches"])

# --- the patching example of docs/patching.md ---
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import twinkle_patches as tp

config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16)
model = Qwen3ForCausalLM(config)
ids = torch.randint(0, 128, (2, 16))
before = model(input_ids=ids).logits

report = tp.apply(model)  # RMSNorm, RoPE and SwiGLU now run twinkle ops; weights untouched
print(report)             # each target swapped (impl, backend) and each skipped, with the reason
after = model(input_ids=ids).logits
print("max |logits diff|", (after - before).abs().max().item())
tp.revert(report)         # the original classes and functions again, identical objects

with tp.patched(model, ops=("rms_norm",)):  # reverted on exit, even on an exception
    model(input_ids=ids).logits.sum().backward()
