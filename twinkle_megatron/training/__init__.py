"""The training engine and one step's pieces, below the model facade.

- :mod:`.engine`: :class:`~.engine.Engine`, what a step needs (the chunks and their DDP wraps,
  megatron's config, the mesh, the MoE aux loss, the LM-head path) and every adapter's
  :class:`~.engine.TrainState`;
- :mod:`.call`: one ``forward_backward`` / ``forward_only`` call planned: its groups (one state
  and its rows each; one group for a single adapter, one per adapter in a mixed batch);
- :mod:`.batching`: inputs to micro-batches (padding, packed samples, context-parallel split);
- :mod:`.layout`: how a micro-batch's tokens are laid out for the model (rows, context-parallel
  shares, packed THD rows, both), one class per layout, and the way back to rows;
- :mod:`.losses`: the losses (cross-entropy, GRPO family, DPO ...) as formulas on per-token
  log-probs, and their registry;
- :mod:`.arguments`: a call's loss arguments checked and laid out in the user's rows;
- :mod:`.loss_step`: the loss end of a forward step, per micro-batch (per-token outputs in rows,
  the loss's inputs);
- :mod:`.reduction`: the loss's statistics and per-token outputs reduced over micro-batches and
  ranks, and read back into a call's result;
- :mod:`.aux_loss`: transformers' pooled MoE load-balancing loss on megatron's routers;
- :mod:`.metrics`: the running metrics behind ``calculate_metric`` and user metrics;
- :mod:`.optim`: the learning-rate schedulers;
- :mod:`.schedule`: a planned call through megatron's pipeline schedule, with the package's one
  ``forward_step`` (and the ``logits()`` forward);
- :mod:`.step`: the optimizer step (grads finalised once, clipped, stepped, zeroed);
- :mod:`.transaction`: a call that raises puts back what it changed (grads, counters, meters, RNG);
- :mod:`.recompute`: activation recompute.

The functions take the engine and the state (or the call) they work on; nothing reads the
facade. From this project they import only each other, :mod:`twinkle_megatron.parallel`,
:mod:`twinkle_megatron.layers` and :mod:`twinkle_megatron.packing`; nothing is imported here.
"""
