"""Single-purpose benchmark scripts beside the ``python -m benchmarks`` harness.

Each runs from the repository root as ``python -m benchmarks.scripts.<name>`` and times with the
harness's one timing loop (:func:`benchmarks.harness.timing.time_fn`, interleaved by
:func:`~benchmarks.harness.timing.time_interleaved`; percentiles by
:func:`~benchmarks.harness.timing.quantile`). Names are ``<subject>_<device>`` for op scripts
(``cpu``: the C++ backend; ``gpu``: the Triton kernels on CUDA, with a ``--device cpu --small``
smoke mode in the Triton interpreter) and ``megatron_<what>`` for the Megatron training steps
(CPU + gloo here):

- ``rowwise_cpu``: RMSNorm, gated RMSNorm, RoPE, SwiGLU on the C++ backend, including the raw
  C++ ops writing into preallocated outputs, against eager, torch.compile and a copy;
- ``rowwise_gpu``: the same ops' Triton kernels against eager and torch.compile, L2 flushed;
- ``gdn_cpu``: the C++ chunked gated delta rule against transformers' torch path, with wall and
  CPU time and the peak RSS of a fresh process;
- ``gdn_gpu``: the Triton gated delta rule against fla and transformers at Qwen3.5 shapes;
- ``moe_cpu``: ``moe_experts`` against transformers' experts implementations, and the grouped
  matmul alone (C++ op, ``torch._grouped_mm``, a loop of ``torch.mm``);
- ``moe_gpu``: the Triton grouped matmul and ``moe_experts`` against ``torch._grouped_mm`` and a
  dense matmul of the same FLOPs;
- ``megatron_facade``: ``MegatronModel``'s step against a hand-written megatron-core step (TP2);
- ``megatron_specs``: the training job's tokens/s with twinkle specs against the local spec (TP2);
- ``megatron_specs_profile``: both specs' steps in the same processes, optionally profiled;
- ``recompute_cpu``: activation memory (peak RSS over the resident state) and time of one
  forward_backward of a Qwen3-4B-width layer stack with none / selective / full recompute.

What the harness measures (every op against every provider, correctness-gated, and the model
steps) belongs in ``benchmarks/harness``; a script is for a measurement the harness's grid does
not express (raw kernels into preallocated buffers, a fresh process's RSS, a launched
multi-rank job).
"""
