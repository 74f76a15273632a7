"""One training step's pieces, below the model facade.

- :mod:`.batching`: inputs to micro-batches (padding, packed samples, context-parallel split);
- :mod:`.losses`: the losses (cross-entropy, GRPO family, DPO ...) as formulas on per-token
  log-probs, and their registry;
- :mod:`.loss_step`: the loss function megatron's schedule calls, per micro-batch, and the
  reduction of its outputs;
- :mod:`.aux_loss`: transformers' pooled MoE load-balancing loss on megatron's routers;
- :mod:`.metrics`: the running metrics behind ``calculate_metric`` and user metrics;
- :mod:`.optim`: the learning-rate schedulers;
- :mod:`.schedule`: one call of megatron's pipeline schedule (and the ``logits()`` forward);
- :mod:`.step`: the optimizer step (grads finalised once, clipped, stepped, zeroed).

From this project they import only each other, :mod:`twinkle_megatron.layers` and
:mod:`twinkle_megatron.packing`; nothing is imported here.
"""
