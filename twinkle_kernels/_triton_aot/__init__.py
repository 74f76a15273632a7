"""The compile lane: every distinct Triton launch the ops make, compiled for sm_80 and sm_90 on a
machine without a GPU, with its registers, stack and shared memory.

The interpreter (``TRITON_INTERPRET=1``) never lowers a kernel, so what only the compiler sees
(loop-carried types, constexpr misuse, register spills, shared memory past the SM's limit) would
first show on a GPU. Launches are never written by hand; they are recorded from real calls
(:mod:`.record`):

- the model-shape table (:mod:`.shapes`): every public op with ``backend="triton"`` at the widths
  of Qwen3-4B, Qwen3-30B-A3B, Qwen3.5 (dense and MoE) and Llama-3-8B, in bf16, fp16 and fp32,
  dense and packed, recorded under the interpreter without running the kernels;
- any JSON-lines file of launches, e.g. the test suite's (``pytest --triton-launches=FILE``, or
  ``TWINKLE_TRITON_LAUNCHES=FILE``; see :mod:`.pytest_plugin`).

They are deduplicated (kernel, argument types and specializations, constexprs, num_warps and
num_stages) and compiled with ``triton.compile`` for each arch in a pool of processes without
``TRITON_INTERPRET`` (:mod:`.compile`); :mod:`.report` prints one line per launch and arch
(REG, STACK, shared memory against the limit, the tile configuration) and a per-kernel summary.

    python -m twinkle_kernels._triton_aot [--arch 80,90] [--launches FILE ...] [--no-table]
        [--models qwen3_5,...] [--dtypes bf16,...] [--kernel state_fwd,...] [--subset all|paths|kernel]
        [--launches-subset ...] [--max-stack BYTES] [--markdown FILE] [--json FILE] [--jobs 2]

Exit status 1 on any compile error or shared memory over the limit on any arch (sm_80
166,912 B, sm_90 232,448 B per block). Stack (local memory: register spills) is reported, and
fails the run only with ``--max-stack``.

CI (``.ci/run``) compiles the whole table on the newest Triton (149 launches x 2 archs: ~120 s of
CPU, ~0.5-4 s per compile; recording the table ~10 s), plus the largest tile of each code path
the test suite reaches that the table does not (``--launches-subset paths``; a path is the kernel,
its pointer dtypes and its non-integer constexprs; ~40 of the suite's ~400 distinct launches). On
the oldest admitted Triton (``.ci/min_versions``, the lent GPU's), where a kernel that 3.9
compiles may still fail, it compiles the largest tile of each code path of the table
(``--subset paths``, ~90 launches), which holds what a GPU launches. A kernel that spills
heavily can take minutes to compile (the delta-rule kernels at d924101: up to 330 s of CPU
each); Triton's own cache makes reruns of unchanged kernels free.

Importing this package imports neither Triton nor torch.
"""
