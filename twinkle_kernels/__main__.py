"""``python -m twinkle_kernels``: what runs here, and a self-check of every op on every backend.

Prints the device, torch version, backends with availability (and the reason when not),
the CPU ISA of the C++ build, then for each op x available backend the max error against
the float64 reference (forward and gradients) and the median time against eager torch.
Exits 1 if any check fails. On a CPU-only machine the Triton backend is checked in its
interpreter, in a child process (``TRITON_INTERPRET`` must be set before Triton loads).
With transformers installed, it also lists per model family which targets ``twinkle_patches.apply``
swaps on that transformers and why any other is skipped (informational: not a check).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def _header(device):
    import platform

    import torch

    from . import _cpu_ext, _dispatch, _verifiers
    print(f"twinkle_kernels {__import__('twinkle_kernels').__version__}")
    print(f"device: {device}" + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else
                                  f" ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"))
    print(f"torch {torch.__version__}, python {platform.python_version()}")
    print(f"cpu ISA: torch {torch.backends.cpu.get_cpu_capability()}, twinkle C++ build: {_cpu_ext.isa()}")
    print("backends:")
    for b in _dispatch.BACKENDS:
        why = _dispatch.backend_status(b)
        if b == "triton" and why is None:
            why = _verifiers.triton_device_reason(torch.empty(0, device=device))
            if why and device.type == "cpu":
                why = "available in the interpreter (checked below with TRITON_INTERPRET=1)"
                print(f"  {b:10s} interpreter: {why}")
                continue
        print(f"  {b:10s} {'available' if why is None else 'unavailable: ' + why}")


def _patch_table(device):
    """Per family: the targets twinkle_patches swaps on the installed transformers, and the skips."""
    try:
        import transformers
        from twinkle_patches import family_swaps
    except ImportError as e:
        print(f"\npatches: not listed ({e})")
        return
    rows = family_swaps(device.type)
    n = sum(len(r.swapped) for r in rows.values())
    total = n + sum(len(r.skipped) for r in rows.values())
    print(f"\npatches (twinkle_patches.apply, transformers {transformers.__version__}, device {device.type}): "
          f"{n}/{total} targets swap")
    for fam, r in rows.items():
        names = [t + ("*" if t in r.hub_wrappers else "") for t in r.swapped]
        count = f"{len(r.swapped)}/{len(r.swapped) + len(r.skipped)}"
        print(f"  {fam:12s} {count:>5s}  {' '.join(names)}")
        for t, why in r.skipped.items():
            print(f"  {'':12s} skipped {t}: {why}")
    if any(r.hub_wrappers for r in rows.values()):
        print("  *: held in transformers' own hub-kernel wrapper, swapped (revert puts the wrapper back)")


def _run_checks(backends, device, dtypes, scale, reps):
    import torch

    from . import _dispatch, _selfcheck
    results = []
    for name, c in _selfcheck.CASES.items():
        for b in backends:
            if b not in _dispatch.op(name).impls:  # e.g. no triton causal_conv1d_update yet
                continue
            for dt in dtypes:
                results.append(_selfcheck.check(c, b, getattr(torch, dt), device, scale, reps))
    return results


def _print(results):
    print(f"\n{'op':24s} {'backend':9s} {'dtype':9s} {'fwd err':>9s} {'grad err':>9s} {'ms':>8s} {'eager ms':>9s} "
          f"{'speedup':>8s}  check")
    for r in results:
        sp = f"{r.eager_ms / r.ms:7.2f}x" if r.ms and r.eager_ms else "      -"
        ms = f"{r.ms:8.3f}" if r.ms else "       -"
        em = f"{r.eager_ms:9.3f}" if r.eager_ms else "        -"
        print(f"{r.op:24s} {r.backend:9s} {r.dtype:9s} {r.fwd_err:9.2e} {r.grad_err:9.2e} {ms} {em} {sp}  "
              f"{'ok' if r.ok else 'FAIL ' + r.note}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m twinkle_kernels", description=__doc__.splitlines()[0])
    p.add_argument("--device", default=None, help="cpu, cuda or npu (default: the best available)")
    p.add_argument("--reps", type=int, default=5, help="timing repetitions (0: no timing)")
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # child-process protocol
    p.add_argument("--backends", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    import torch

    from . import _selfcheck
    if args.device:
        device = torch.device(args.device)
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        device = torch.device("cpu")

    if args.json:  # child: run the asked backends, print results as JSON
        res = _run_checks(args.backends.split(","), device, ["float32"], 1, args.reps)
        print(json.dumps([r.__dict__ for r in res]))
        return 0

    _header(device)
    _patch_table(device)
    backends = _selfcheck.runnable_backends(device)
    dtypes = ["float32", "bfloat16", "float16"]
    results = _run_checks(backends, device, dtypes, 64 if device.type == "cpu" else 512, args.reps)

    if device.type == "cpu" and "triton" not in backends:
        from . import _dispatch
        if _dispatch.backend_status("triton") is None:
            env = dict(os.environ, TRITON_INTERPRET="1")
            out = subprocess.run([sys.executable, "-m", "twinkle_kernels", "--json", "--backends", "triton",
                                  "--device", "cpu", "--reps", "1"], env=env, capture_output=True, text=True)
            if out.returncode != 0:
                print(out.stdout + out.stderr)
                results.append(_selfcheck.Result("triton-interpreter", "triton", "float32", False, 0, 0, None, None,
                                                 "child process failed"))
            else:
                for d in json.loads(out.stdout.strip().splitlines()[-1]):
                    d["backend"] = "triton*"
                    results.append(_selfcheck.Result(**d))
    _print(results)
    if any(r.backend == "triton*" for r in results):
        print("triton*: Triton interpreter on CPU (fp32, small shape); its times say nothing about GPU speed.")
    failed = [r for r in results if not r.ok]
    print(f"\n{len(results) - len(failed)}/{len(results)} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
