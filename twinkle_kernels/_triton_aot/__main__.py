"""``python -m twinkle_kernels._triton_aot``: record, compile for sm_80 and sm_90, report; see the package."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time


def _args(argv):
    ap = argparse.ArgumentParser(prog="python -m twinkle_kernels._triton_aot",
                                 description="compile every recorded Triton launch for CUDA archs, no GPU needed")
    ap.add_argument("--arch", default="80,90", help="compute capabilities, comma-separated (default 80,90)")
    ap.add_argument("--launches", action="append", default=[], metavar="JSONL",
                    help="recorded launches to compile as well (e.g. the test suite's); repeatable")
    ap.add_argument("--no-table", action="store_true", help="skip the model-shape table")
    ap.add_argument("--models", default=None, help="table models, comma-separated (default: all)")
    ap.add_argument("--dtypes", default=None, help="table dtypes, comma-separated (default: bf16,fp16,fp32)")
    ap.add_argument("--kernel", default=None, help="only kernels whose name contains one of these (comma-separated)")
    ap.add_argument("--subset", choices=SUBSETS, default="all",
                    help="which launches to compile: all; paths: the largest tile of each code path (kernel, "
                         "pointer dtypes, non-integer constexprs); kernel: the largest tile of each kernel")
    ap.add_argument("--launches-subset", choices=SUBSETS, default=None,
                    help="the same choice for the --launches files only (default: --subset); paths and kernel "
                         "also leave out what the table compiles")
    ap.add_argument("--jobs", type=int, default=2, help="compile processes (default 2)")
    ap.add_argument("--max-stack", type=int, default=None, help="also fail on more stack bytes than this")
    ap.add_argument("--markdown", default=None, metavar="FILE", help="write the per-kernel summary as markdown")
    ap.add_argument("--json", default=None, metavar="FILE", help="write every launch with its results as JSON "
                    "(python -m twinkle_kernels._triton_aot.report BEFORE AFTER compares two)")
    ap.add_argument("--save-launches", default=None, metavar="JSONL", help="write the launches compiled")
    ap.add_argument("--quiet", action="store_true", help="no line per launch, only the summary")
    return ap.parse_args(argv)


def _record_table(args, out: str) -> None:
    cmd = [sys.executable, "-m", "twinkle_kernels._triton_aot.shapes", "--out", out]
    if args.models:
        cmd += ["--models", args.models]
    if args.dtypes:
        cmd += ["--dtypes", args.dtypes]
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(cmd, env=env)
    if proc.returncode:
        raise SystemExit(f"recording the model table failed (exit {proc.returncode})")


SUBSETS = ("all", "paths", "kernel")


def _tile_size(launch) -> int:
    size = 1
    for v in launch.constexprs.values():
        if isinstance(v, int) and not isinstance(v, bool) and v > 1:
            size *= v
    return size * launch.options.get("num_stages", 1) * launch.options.get("num_warps", 1)


def _path(launch, mode: str):
    """What a subset keeps one launch of: the kernel (``kernel``), or the code path (``paths``):
    kernel, pointer dtypes and the constexprs that are not tile sizes (integers, and the arguments the
    launcher folded because they were 1, are shapes, not paths)."""
    if mode == "kernel":
        return launch.kernel
    from .record import pointer_dtypes
    switches = sorted((k, v) for k, v in launch.constexprs.items() if not isinstance(v, int) or isinstance(v, bool))
    return launch.kernel, pointer_dtypes(launch), str(switches)


def _subset(launches, mode: str, covered=()):
    """``launches`` reduced to the largest tile per code path or per kernel (``mode``, see --subset),
    leaving out the paths of ``covered`` (launches compiled anyway)."""
    if mode == "all":
        return launches
    done = {_path(lc, mode) for lc in covered}
    best = {}
    for launch in launches:
        key = _path(launch, mode)
        if key in done:
            continue
        if key not in best or _tile_size(launch) > _tile_size(best[key]):
            best[key] = launch
    return list(best.values())


def main(argv=None) -> int:
    args = _args(argv)
    # with the interpreter active the compiler's front end breaks: clear it before Triton loads
    os.environ.pop("TRITON_INTERPRET", None)
    import triton

    from . import record, report
    from .compile import SHARED_LIMIT, compile_all

    archs = [int(a) for a in args.arch.split(",")]
    unknown = [a for a in archs if a not in SHARED_LIMIT]
    if unknown:
        raise SystemExit(f"--arch: no shared-memory limit known for {unknown} (known: {sorted(SHARED_LIMIT)})")
    t0 = time.time()
    table = []
    if not args.no_table:
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "table.jsonl")
            _record_table(args, path)
            table = _subset(record.read_jsonl(path), args.subset)
    # from the files, only paths the table does not compile already
    files = _subset(record.merge(*(record.read_jsonl(p) for p in args.launches)), args.launches_subset or args.subset,
                    covered=table)
    launches = record.merge(table, files)
    if args.kernel:
        wanted = args.kernel.split(",")
        launches = [lc for lc in launches if any(w in lc.name for w in wanted)]
    if args.save_launches:
        record.write_jsonl(args.save_launches, launches)
    t1 = time.time()
    print(f"triton {triton.__version__}: compiling {len(launches)} distinct launches for "
          f"{', '.join(f'sm_{a}' for a in archs)} ({args.jobs} processes)", flush=True)
    show = None if args.quiet else (lambda launch, r: print(report.launch_line(launch, r), flush=True))
    compiled = compile_all(launches, archs, jobs=args.jobs, on_result=show)
    print("\n".join(report.summary_lines(compiled)))
    bad = report.failures(compiled, args.max_stack)
    with_stack = sum(1 for _, rs in compiled for r in rs if r.stack)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(report.markdown(compiled))
    if args.json:
        import json
        with open(args.json, "w") as f:
            json.dump(report.to_json(compiled, triton.__version__), f, indent=1)
    cpu = sum(r.seconds for _, rs in compiled for r in rs)
    print(f"triton {triton.__version__}: {len(launches)} launches x {len(archs)} archs compiled in "
          f"{time.time() - t1:.0f} s ({cpu:.0f} s CPU; recorded in {t1 - t0:.0f} s); {len(bad)} failure(s); "
          f"{with_stack} compile(s) with stack (reported, not a failure"
          f"{'' if args.max_stack is None else f' up to {args.max_stack} B'})", flush=True)
    for line in bad:
        print(f"FAILED: {line}")
    if not launches:
        print("FAILED: no launches to compile")
        return 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
