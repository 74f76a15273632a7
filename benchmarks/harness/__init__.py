"""The benchmark harness behind ``python -m benchmarks`` (and the timing of ``benchmarks/scripts``).

Modules: :mod:`.ops` (what is measured: shapes, inputs, minimum bytes / FLOPs),
:mod:`.providers` (twinkle backends and peers), :mod:`.runner` (rooflines, correctness gate,
timing), :mod:`.timing` (the one timing loop, interleaved rounds, percentiles, peak memory),
:mod:`.model_step` (HF and Megatron steps), :mod:`.gemm_floor` (a step's matrix products
recorded and replayed alone: the floor under the same products), :mod:`.report` (JSON, CSV,
Markdown, PNG, console, comparison), :mod:`.env` (machine, versions, git commit, the child
processes' environment).
Multi-rank rows run on the project's one local launcher,
:func:`twinkle_megatron.parallel.launch.run_ranks` (free port, hard timeout).

Extending it:

- an op: an :class:`~.ops.OpSpec` in ``ops.OPS`` (canonical inputs, shapes, minimum cost);
- a peer implementation of an op: a ``Provider`` in ``providers.PEERS``;
- a model-step row: an entry of ``model_step.HF_VARIANTS`` or ``model_step.MEGATRON_VARIANTS``,
  or a new kind of step in ``model_step.MODEL_STEPS``;
- a measurement outside that grid: a script in ``benchmarks/scripts`` timed with
  :func:`.timing.time_fn` / :func:`.timing.time_interleaved`.
"""
