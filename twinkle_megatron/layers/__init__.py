"""The layer modules of the facade's megatron-core models, one module per kind.

- :mod:`.norm`: RMSNorm (local, Hugging Face rounding), ``TwinkleRMSNorm`` (``tk.rms_norm``), the
  gated output norm;
- :mod:`.attention`: core attention (packed THD, context parallel), rotary and SDPA on
  twinkle_kernels, ``TwinkleSelfAttention``;
- :mod:`.gated_delta_net`: the Gated DeltaNet, local (megatron's torch path) and on twinkle_kernels;
- :mod:`.mlp`: ``TwinkleMLP`` (SwiGLU) and ``TwinkleGroupedMLP`` (MoE experts as grouped matmuls);
- :mod:`.router`: megatron's TopKRouter collecting transformers' pooled MoE load-balancing loss
  (:mod:`twinkle_megatron.training.aux_loss`);
- :mod:`.vocab_parallel`: per-token log-probs and entropy over vocab-parallel logits (used by the
  loss step, not chosen in the spec);
- :mod:`.lm_head`: the GPTModel that can return its final hidden states, and the per-token
  log-probs / entropy from them and the output weight shard with the fused linear cross-entropy
  (``MegatronModel(fused_linear_ce=True)``).

The modules are chosen by :mod:`twinkle_megatron.spec`. From this project they import only each
other, :mod:`twinkle_megatron.packing` and :mod:`twinkle_kernels` (``tests/repo/test_structure.py``
checks it), and megatron-core only when a class is first built. Nothing is imported here, so a
submodule loads only when asked for.
"""
