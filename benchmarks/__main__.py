"""``python -m benchmarks``: every twinkle op and model step against eager torch, torch.compile
and the peers installed here, correctness-gated, with the machine's copy and matmul rooflines
measured in the same run.

Examples::

    python -m benchmarks --quick --out benchmarks/results/quick_cpu_$(date +%F)
    python -m benchmarks --ops rms_norm,swiglu --dtypes bfloat16 --backends triton --out out/gpu
    python -m benchmarks --compare out/a/results.json out/b/results.json
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def _csv(s: str):
    return [x.strip() for x in s.split(",") if x.strip()]


def parse_args(argv=None):
    from benchmarks.harness.model_step import MODEL_STEPS
    from benchmarks.harness.ops import ALL_MODES, MODES, OPS
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", type=_csv, default=list(OPS), help=f"comma list, default all: {','.join(OPS)}")
    p.add_argument("--backends", type=_csv, default=["cpu", "triton", "npu"],
                   help="twinkle backends to time (default cpu,triton,npu; those that cannot run here are "
                        "reported as missing)")
    p.add_argument("--dtypes", type=_csv, default=["float32", "bfloat16"], help="default float32,bfloat16")
    p.add_argument("--modes", type=_csv, default=list(MODES),
                   help="default fwd,bwd,fwd+bwd; also nograd (the forward under torch.no_grad)")
    p.add_argument("--providers", type=_csv, default=None,
                   help="keep only these providers (eager is always kept), e.g. twinkle-cpu,torch.compile")
    p.add_argument("--device", default=None, help="cpu, cuda or npu (default: cuda if available, else cpu)")
    p.add_argument("--quick", action="store_true", help="scaled-down shapes and short timing (seconds on CPU)")
    p.add_argument("--no-model-step", action="store_true", help="skip the HF / Megatron model steps")
    p.add_argument("--model-steps", type=_csv, default=None,
                   help=f"comma list of model steps to run, default all: {','.join(MODEL_STEPS)}")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend of the compiled HF model steps (default inductor; aot_eager "
                        "where inductor cannot build)")
    p.add_argument("--hf-variants", type=_csv, default=None,
                   help="comma list of HF model-step variants besides unpatched (default: twinkle_patches, "
                        "torch.compile, torch.compile + twinkle_patches; also 'torch.compile + twinkle_patches "
                        "(kernels)', '... (decompose_rowwise)' and '... (decompose_all)', apply's other "
                        "under_compile choices)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads before running, and OMP_NUM_THREADS of the model-step children (CPU)")
    p.add_argument("--out", default=None, help="directory for results.json/.csv, summary.md and PNGs")
    p.add_argument("--note", default="", help="a line added to the top of summary.md")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), help="print B's ratios against A and exit")
    args = p.parse_args(argv)
    bad = [o for o in args.ops if o not in OPS]
    if bad:
        p.error(f"unknown op(s) {bad}; expected some of {list(OPS)}")
    bad = [m for m in args.model_steps or () if m not in MODEL_STEPS]
    if bad:
        p.error(f"unknown model step(s) {bad}; expected some of {list(MODEL_STEPS)}")
    from benchmarks.harness.model_step import HF_VARIANTS
    bad = [v for v in args.hf_variants or () if v not in HF_VARIANTS]
    if bad:
        p.error(f"unknown HF variant(s) {bad}; expected some of {list(HF_VARIANTS)}")
    bad = [m for m in args.modes if m not in ALL_MODES]
    if bad:
        p.error(f"unknown mode(s) {bad}; expected some of {list(ALL_MODES)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from benchmarks.harness import report
    if args.compare:
        report.compare(report.load(args.compare[0]), report.load(args.compare[1]))
        return 0
    import torch

    from benchmarks.harness.runner import Config, run
    dtypes = []
    for d in args.dtypes:
        dt = getattr(torch, d, None)
        if not isinstance(dt, torch.dtype):
            print(f"--dtypes: {d!r} is not a torch dtype", file=sys.stderr)
            return 2
        dtypes.append(dt)
    if args.threads:
        torch.set_num_threads(args.threads)
        # the model steps run in child processes, which take their thread count from here (else
        # they use every core, and under contention their idle threads spin)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg = Config(ops=args.ops, backends=args.backends, dtypes=dtypes, modes=args.modes, providers=args.providers,
                 quick=args.quick, device=dev, model_step=not args.no_model_step, model_steps=args.model_steps,
                 compile_backend=args.compile_backend, hf_variants=args.hf_variants,
                 progress=not args.no_progress)
    t0 = time.perf_counter()
    result = run(cfg)
    result["meta"]["argv"] = sys.argv[1:] if argv is None else list(argv)
    result["meta"]["wall_s"] = round(time.perf_counter() - t0, 1)
    result["meta"]["note"] = args.note
    report.console_table(result)
    if args.out:
        paths = report.write_all(result, args.out, args.note)
        print(f"\nwrote {paths['json']}, {paths['csv']}, {paths['md']} and {len(paths['png'])} PNGs "
              f"({result['meta']['wall_s']} s)")
    wrong = [r for r in result["rows"] if r.get("status") == "wrong" and r.get("family") == "twinkle"]
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
