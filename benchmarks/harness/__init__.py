"""The benchmark harness behind ``python -m benchmarks``.

Modules: :mod:`.ops` (what is measured: shapes, inputs, minimum bytes / FLOPs),
:mod:`.providers` (twinkle backends and peers), :mod:`.runner` (rooflines, correctness gate,
timing), :mod:`.timing` (medians, percentiles, peak memory), :mod:`.model_step` (HF and
Megatron steps), :mod:`.report` (JSON, CSV, Markdown, PNG, console, comparison),
:mod:`.env` (machine, versions, git commit).
"""
