"""The row-wise ops under ``torch.compile`` on the CPU: the custom ops against inductor's own fusion.

Per op (rms_norm, gated_rms_norm, swiglu, swiglu_packed, apply_rotary_pos_emb), fp32, forward and
backward, at a small and a large shape, three sides timed in interleaved rounds:

- ``eager``    : the public twinkle function, called eagerly (the C++ backend's autograd Function);
- ``compiled`` : ``torch.compile`` (inductor) of the same public function: the graph holds the
  ``twinkle::`` custom op and its backward op;
- ``ref-compiled``: ``torch.compile`` (inductor) of the pure-torch reference, which inductor fuses.

A run is ``torch.autograd.backward(fn(*inputs), dy)`` on leaf inputs (gradients reset between runs).
Before timing, every side's outputs and gradients are checked against the eager twinkle call.

    python -m benchmarks.scripts.compiled_ops_cpu --json out.json      # one process, every side
    python -m benchmarks.scripts.compiled_ops_cpu --trees before=/path/a after=/path/b --rounds 3 --md out.md

With ``--trees``, each round runs one child process per tree (PYTHONPATH set to that tree, in
alternating order per round), so two commits are compared under the same load; each side's runs are
pooled over the rounds and the median reported. Shapes: ``[M, N]`` rows for the norms and swiglu
(swiglu_packed: ``[M, 2N]``), q and k ``[1, N / 128, M, 128]`` for the rotary embedding.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
from typing import Callable, Dict, List, Tuple

SHAPES = ((128, 128), (4096, 2048))
OPS = ("rms_norm", "gated_rms_norm", "swiglu", "swiglu_packed", "apply_rotary_pos_emb")
MATMUL_OPS = ("grouped_matmul", "fused_linear_cross_entropy", "fused_linear_cross_entropy+logps")
SIDES = ("eager", "compiled", "ref-compiled")


def _cases(m: int, n: int):
    """(op, twinkle fn, reference fn, inputs, upstream grads) at [m, n]."""
    import torch

    import twinkle_kernels as tk
    from twinkle_kernels.norm import gated_rms_norm_reference, rms_norm_reference
    from twinkle_kernels.rope import apply_rotary_pos_emb_reference
    from twinkle_kernels.swiglu import swiglu_packed_reference, swiglu_reference

    g = torch.Generator().manual_seed(0)

    def r(*s):
        return torch.randn(*s, generator=g)

    yield ("rms_norm", lambda x, w: tk.rms_norm(x, w, 1e-6), lambda x, w: rms_norm_reference(x, w, 1e-6),
           (r(m, n), r(n)), (r(m, n),))
    yield ("gated_rms_norm", lambda x, z, w: tk.gated_rms_norm(x, z, w, 1e-6),
           lambda x, z, w: gated_rms_norm_reference(x, z, w, 1e-6), (r(m, n), r(m, n), r(n)), (r(m, n),))
    yield "swiglu", tk.swiglu, swiglu_reference, (r(m, n), r(m, n)), (r(m, n),)
    yield "swiglu_packed", tk.swiglu_packed, swiglu_packed_reference, (r(m, 2 * n),), (r(m, n),)
    h, d = max(1, n // 128), min(n, 128)
    cos, sin = r(1, m, d), r(1, m, d)
    yield ("apply_rotary_pos_emb", lambda q, k: tk.apply_rotary_pos_emb(q, k, cos, sin),
           lambda q, k: apply_rotary_pos_emb_reference(q, k, cos, sin), (r(1, h, m, d), r(1, h, m, d)),
           (r(1, h, m, d), r(1, h, m, d)))
    # matmul-bound: x [M, N] over E experts of [N, N / 8] (the reference's per-expert loop reads the
    # offsets' values, so it is not compiled); the LM head [N, N] with its loss
    e, i = (4, 128) if m <= 128 else (8, n // 8)
    offs = torch.linspace(0, m, e + 1)[1:].round().to(torch.int32)
    yield "grouped_matmul", lambda x, w: tk.grouped_matmul(x, w, offs), None, (r(m, n), r(e, n, i)), (r(m, i),)
    y = torch.randint(0, n, (m,), generator=g)
    y[::7] = -100
    from twinkle_kernels.linear_ce import fused_linear_cross_entropy_reference as flce_ref
    yield ("fused_linear_cross_entropy", lambda h_, w: tk.fused_linear_cross_entropy(h_, w, y),
           lambda h_, w: flce_ref(h_, w, y), (r(m, n), r(n, n) * 0.05), (torch.tensor(1.0),))
    yield ("fused_linear_cross_entropy+logps",
           lambda h_, w: tk.fused_linear_cross_entropy(h_, w, y, return_logps=True),
           lambda h_, w: flce_ref(h_, w, y, return_logps=True), (r(m, n), r(n, n) * 0.05),
           (torch.tensor(1.0), r(m)))


def _run_fn(fn: Callable, inputs, dy) -> Callable[[], None]:
    import torch

    def run():
        out = fn(*inputs)
        torch.autograd.backward(out if isinstance(out, tuple) else (out,), dy)
        for t in inputs:
            t.grad = None
    return run


def _check(name: str, fn: Callable, want_fn: Callable, inputs, dy) -> None:
    import torch

    def grads(f):
        out = f(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        return [o.detach() for o in outs] + list(torch.autograd.grad(outs, inputs, dy))
    for a, b in zip(grads(fn), grads(want_fn)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def measure(threads: int, reps: int, budget_s: float, ops) -> List[dict]:
    """Every op x shape x side in this process: rows with the per-run times in ms."""
    import torch

    from benchmarks.harness import timing

    torch.set_num_threads(threads)
    torch._dynamo.config.cache_size_limit = 64
    rows = []
    for m, n in SHAPES:
        for name, tw, ref, inputs, dy in _cases(m, n):
            if name not in ops:
                continue
            leaves = tuple(t.requires_grad_() for t in inputs)
            fns = {"eager": tw, "compiled": torch.compile(tw, dynamic=False)}
            if ref is not None:
                fns["ref-compiled"] = torch.compile(ref, dynamic=False)
            for side, fn in fns.items():
                _check(f"{name} {side}", fn, tw, leaves, dy)
            runs = {side: _run_fn(fn, leaves, dy) for side, fn in fns.items()}
            got, errors = timing.time_interleaved(runs, torch.device("cpu"),
                                                  dict(min_reps=reps, max_reps=reps, budget_s=budget_s), 3,
                                                  alternate=True)
            if errors:
                raise RuntimeError(f"{name}: {errors}")
            for side, t in got.items():
                rows.append({"op": name, "shape": f"{m}x{n}", "side": side, "times_ms": t.times})
    return rows


PEAK_SHAPE = (1024, 1024, 32768)  # N, H, V of the fused CE whose peak memory --peak measures


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def peak(side: str) -> int:
    """Peak-RSS delta (bytes) of one forward+backward of the loss-only fused CE at PEAK_SHAPE, eager or
    compiled (inductor), after two warm-up runs: ``VmHWM`` after the run minus ``VmRSS`` before it
    (the high-water mark reset through ``/proc/self/clear_refs``)."""
    import torch

    import twinkle_kernels as tk
    torch.set_num_threads(1)
    n, h, v = PEAK_SHAPE
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, generator=g).requires_grad_()
    w = (torch.randn(v, h, generator=g) * 0.05).requires_grad_()
    y = torch.randint(0, v, (n,), generator=g)

    def f(x, w):  # chunks of 128 rows (16 MiB of logits): the [V, H] weight gradient dominates the peak
        return tk.fused_linear_cross_entropy(x, w, y, chunk_size=128)
    fn = torch.compile(f, dynamic=False) if side == "compiled" else f
    for _ in range(2):
        fn(x, w).backward()
        x.grad = w.grad = None
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    before = _status_bytes("VmRSS")
    fn(x, w).backward()
    return _status_bytes("VmHWM") - before


def _git_head(tree: str) -> str:
    try:
        return subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def compare(trees: Dict[str, str], rounds: int, args) -> Tuple[Dict[tuple, List[float]], Dict[tuple, List[float]],
                                                                List[str]]:
    """Child processes per tree in alternating order per round: the per-run times pooled per side, and
    per (tree, op, shape, side) the ratio of the side's median to eager's in each child (the load
    changes between children; inside one the sides share it)."""
    import tempfile

    pooled: Dict[tuple, List[float]] = {}
    ratios: Dict[tuple, List[float]] = {}
    loads = []
    # one inductor cache per tree: AOTAutograd's cache is keyed on the forward graph, so a backward
    # compiled against one tree's custom ops would be reused for another's
    caches = {label: tempfile.mkdtemp(prefix=f"compiled_ops_{label}_") for label in trees}
    for r in range(rounds):
        order = list(trees.items())
        for label, tree in (order[::-1] if r % 2 else order):
            loads.append(open("/proc/loadavg").read().split()[0])
            out = os.path.join("/tmp", f"compiled_ops_{os.getpid()}_{label}_{r}.json")
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, os.getcwd()]), OMP_NUM_THREADS=str(args.threads),
                       TORCHINDUCTOR_CACHE_DIR=caches[label])
            # -P: the working directory does not shadow the tree's twinkle_kernels
            subprocess.run([sys.executable, "-P", "-m", "benchmarks.scripts.compiled_ops_cpu", "--json", out,
                            "--ops", ",".join(args.ops),
                            "--threads", str(args.threads), "--reps", str(args.reps), "--budget", str(args.budget)],
                           env=env, check=True)
            with open(out) as f:
                got = json.load(f)
            eager = {(row["op"], row["shape"]): statistics.median(row["times_ms"]) for row in got
                     if row["side"] == "eager"}
            for row in got:
                key = (label, row["op"], row["shape"], row["side"])
                pooled.setdefault(key, []).extend(row["times_ms"])
                ratios.setdefault(key, []).append(statistics.median(row["times_ms"]) / eager[row["op"], row["shape"]])
            os.unlink(out)
    for d in caches.values():
        shutil.rmtree(d, ignore_errors=True)
    return pooled, ratios, loads


def markdown(pooled: Dict[tuple, List[float]], ratios: Dict[tuple, List[float]], trees: Dict[str, str],
             loads: List[str], args) -> str:
    import torch

    labels = list(trees)
    lines = [f"# twinkle custom ops under torch.compile, CPU, fp32 forward+backward ({datetime.date.today()})", "",
             f"Command: `python -m benchmarks.scripts.compiled_ops_cpu {' '.join(sys.argv[1:])}`", "",
             "Trees: " + ", ".join(f"`{k}` = {args.commits.get(k) or _git_head(v)}" for k, v in trees.items())
             + f"; torch {torch.__version__}, {args.threads} thread(s), {args.rounds} rounds of one child process "
             f"per tree (alternating order), each timing its sides in 3 interleaved rounds; load average (1 min) "
             f"at each child's start: {', '.join(loads)}.", "",
             "Median ms per forward+backward (runs pooled over the rounds); `compiled` is inductor over the public "
             "function (the twinkle custom ops), `ref-compiled` inductor over the pure-torch reference.", ""]
    head = ["op", "shape"] + [f"{side} ({lab})" for lab in labels for side in SIDES]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    order = OPS + MATMUL_OPS
    keys = sorted({(k[1], k[2]) for k in pooled}, key=lambda k: (order.index(k[0]), k[1]))
    for op, shape in keys:
        cells = []
        for lab in labels:
            for side in SIDES:
                ts = pooled.get((lab, op, shape, side))
                cells.append(f"{statistics.median(ts):.3f}" if ts else "-")
        lines.append(f"| {op} | {shape} | " + " | ".join(cells) + " |")
    lines += ["", "Time over eager twinkle's in the same child process (median over the children; steadier than the "
              "times above when the load changes between children):", ""]
    head = ["op", "shape"] + [f"{side} ({lab})" for lab in labels for side in SIDES[1:]]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for op, shape in keys:
        cells = [f"{statistics.median(ratios[lab, op, shape, side]):.2f}" if (lab, op, shape, side) in ratios else "-"
                 for lab in labels for side in SIDES[1:]]
        lines.append(f"| {op} | {shape} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="measure in this process, write the rows here")
    p.add_argument("--peak", choices=("eager", "compiled"), help="print peak memory of the fused CE (see peak())")
    p.add_argument("--trees", nargs="*", help="label=path: compare these source trees in child processes")
    p.add_argument("--md", help="with --trees: write the table here")
    p.add_argument("--commit", nargs="*", default=[], help="label=commit: what a tree (a copy) holds, for the table")
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated; also " + ",".join(MATMUL_OPS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=30, help="runs per side per process (split over 3 rounds)")
    p.add_argument("--budget", type=float, default=3.0, help="seconds per side per process")
    args = p.parse_args(argv)
    args.ops = args.ops.split(",")
    if args.peak:
        print(json.dumps({"side": args.peak, "shape": PEAK_SHAPE, "peak_delta_mib": peak(args.peak) / 2**20}))
        return
    if args.trees:
        trees = dict(t.split("=", 1) for t in args.trees)
        args.commits = dict(c.split("=", 1) for c in args.commit)
        pooled, ratios, loads = compare(trees, args.rounds, args)
        text = markdown(pooled, ratios, trees, loads, args)
        print(text)
        if args.md:
            with open(args.md, "w") as f:
                f.write(text)
        return
    import twinkle_kernels
    print(f"twinkle_kernels from {os.path.dirname(twinkle_kernels.__file__)}", file=sys.stderr)
    rows = measure(args.threads, args.reps, args.budget, args.ops)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)
    for row in rows:
        print(row["op"], row["shape"], row["side"], f"{statistics.median(row['times_ms']):.3f} ms")


if __name__ == "__main__":
    main()
