"""Benchmarks of the twinkle backend. Not installed by ``pip install`` (a top-level package named
``benchmarks`` would collide with other projects'): run from the repository root of a checkout.

- ``python -m benchmarks``: the harness (every op and model step, correctness-gated);
- ``python -m benchmarks.scripts.<name>``: single-purpose scripts on the harness's timing;
- ``bash benchmarks/gpu_check.sh``: the one-call check of a lent GPU machine.
"""
