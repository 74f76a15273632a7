"""Time the Triton row-wise ops on a CUDA GPU against eager torch and torch.compile.

Ops: rms_norm, gated_rms_norm, apply_rotary_pos_emb, swiglu, swiglu_packed; forward and
forward+backward; fp32 and bf16 at about 4096 x 4096. Baselines are the package's
readable references run eagerly and through ``torch.compile``, and Liger-Kernel's RMSNorm,
RoPE and SwiGLU (``liger_kernel.transformers.functional``) where it imports (reported as
missing in the results' ``peers`` otherwise). A device copy of the same
size is timed in the same run, and every row reports its bandwidth (minimal bytes moved /
median time) and its ratio to that copy. Each timed call is preceded by an L2 flush
(outside the timed region); times are the harness's (``benchmarks.harness.timing.time_fn``: CUDA-event
medians with p20 / p80).

Before timing, each Triton op is checked against the float64 reference at the timed shape
(forward and gradients; the max errors go into the report).

Usage (from the repository root)::

    python -m benchmarks.scripts.rowwise_gpu [--out DIR] [--reps 30] [--no-compile] [--budget-s 90]
    TRITON_INTERPRET=1 python -m benchmarks.scripts.rowwise_gpu --device cpu --small --dtypes float32 --reps 1 --warmup 0

Writes ``rowwise_gpu.json`` and ``rowwise_gpu.md`` into ``--out`` (default ``$OUT`` or
``./out``). Without CUDA it prints why and exits 0.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

import twinkle_kernels as tk
from benchmarks.harness.env import describe
from benchmarks.harness.timing import time_fn
from twinkle_kernels.norm import gated_rms_norm_reference, rms_norm_reference
from twinkle_kernels.rope import apply_rotary_pos_emb_reference
from twinkle_kernels.swiglu import swiglu_packed_reference, swiglu_reference
from twinkle_kernels.testing import max_error

M, N = 4096, 4096
ROPE = dict(B=4, S=1024, HQ=32, HK=8, D=128)  # 4096 tokens; q has 4096 x 4096 elements
_EXTRAS = ("rms_norm_offset1", "swiglu_packed")


class Case:
    """One op at one dtype: its inputs, the three implementations and the bytes it must move."""

    def __init__(self, name, make, triton_fn, ref_fn, fwd_elems, fwdbwd_elems):
        self.name, self.make, self.triton_fn, self.ref_fn = name, make, triton_fn, ref_fn
        self.fwd_elems, self.fwdbwd_elems = fwd_elems, fwdbwd_elems


def _liger(name):
    """Liger-Kernel's implementation of the op ``name`` with the case's arguments (ImportError when
    Liger is not installed; None where it has no such op)."""
    from liger_kernel.transformers import functional as lf
    if name == "rms_norm":
        return lambda x, w: lf.liger_rms_norm(x, w, 1e-6)
    if name == "rms_norm_offset1":
        return lambda x, w: lf.liger_rms_norm(x, w, 1e-6, offset=1.0, casting_mode="gemma")
    if name == "swiglu":
        return lf.liger_swiglu
    if name == "apply_rotary_pos_emb":
        # Liger takes q / k as [B, H, S, D]; the case's are [B, S, H, D] (head dim 2)
        def rope(q, k, c, s):
            qe, ke = lf.liger_rope(q.transpose(1, 2), k.transpose(1, 2), c, s)
            return qe.transpose(1, 2), ke.transpose(1, 2)
        return rope
    return None


def _cases(dev):
    def rand(*shape, dtype, scale=1.0):
        return (torch.randn(*shape, device=dev, dtype=torch.float32) * scale).to(dtype)

    def norm_in(dtype):
        return [rand(M, N, dtype=dtype).requires_grad_(), rand(N, dtype=dtype).requires_grad_()]

    def gated_in(dtype):
        x, w = norm_in(dtype)
        return [x, rand(M, N, dtype=dtype).requires_grad_(), w]

    def rope_in(dtype):
        r = ROPE
        q = rand(r["B"], r["S"], r["HQ"], r["D"], dtype=dtype).requires_grad_()
        k = rand(r["B"], r["S"], r["HK"], r["D"], dtype=dtype).requires_grad_()
        ang = torch.randn(r["B"], r["S"], r["D"] // 2, device=dev)
        ang = torch.cat((ang, ang), -1)
        return [q, k, ang.cos().to(dtype), ang.sin().to(dtype)]

    def swiglu_in(dtype):
        return [rand(M, N, dtype=dtype, scale=3).requires_grad_(), rand(M, N, dtype=dtype).requires_grad_()]

    def packed_in(dtype):
        return [rand(M, 2 * N, dtype=dtype, scale=3).requires_grad_()]

    r = ROPE
    qk = r["B"] * r["S"] * (r["HQ"] + r["HK"]) * r["D"]
    mn = M * N
    return [
        # elements moved: forward reads x writes y; backward reads dy, x, writes dx (weights negligible)
        Case("rms_norm", norm_in, lambda x, w: tk.rms_norm(x, w, 1e-6, backend="triton"),
             lambda x, w: rms_norm_reference(x, w, 1e-6), 2 * mn, 5 * mn),
        Case("rms_norm_offset1", norm_in, lambda x, w: tk.rms_norm(x, w, 1e-6, offset=1.0, backend="triton"),
             lambda x, w: rms_norm_reference(x, w, 1e-6, 1.0), 2 * mn, 5 * mn),
        Case("gated_rms_norm", gated_in, lambda x, g, w: tk.gated_rms_norm(x, g, w, 1e-6, backend="triton"),
             lambda x, g, w: gated_rms_norm_reference(x, g, w, 1e-6), 3 * mn, 8 * mn),
        Case("apply_rotary_pos_emb", rope_in,
             lambda q, k, c, s: tk.apply_rotary_pos_emb(q, k, c, s, 2, backend="triton"),
             lambda q, k, c, s: apply_rotary_pos_emb_reference(q, k, c, s, 2), 2 * qk, 4 * qk),
        Case("swiglu", swiglu_in, lambda g, u: tk.swiglu(g, u, backend="triton"), swiglu_reference,
             3 * mn, 8 * mn),
        Case("swiglu_packed", packed_in, lambda x: tk.swiglu_packed(x, backend="triton"), swiglu_packed_reference,
             3 * mn, 8 * mn),
    ]


def make_timer(dev, reps, warmup):
    """``timer(fn)`` -> the harness's timing of ``fn`` over exactly ``reps`` runs, each preceded by an
    L2 flush outside the timed region (a buffer larger than the H200's 50 MB L2, zeroed)."""
    flush = torch.empty(256 * 2**20 if dev.type == "cuda" else 0, dtype=torch.uint8, device=dev)

    def timer(fn):
        t = time_fn(fn, dev, warmup=warmup, min_reps=reps, max_reps=reps, budget_s=0.0, before=flush.zero_)
        return t.as_dict()
    return timer


def _outputs(out):
    return out if isinstance(out, tuple) else (out,)


def _fwd(fn, args):
    def run():
        with torch.no_grad():
            fn(*args)
    return run


def _fwdbwd(fn, args, dys):
    leaves = [a for a in args if a.requires_grad]

    def run():
        torch.autograd.grad(_outputs(fn(*args)), leaves, dys)
    return run


def _verify(case, args):
    """Max errors of the Triton forward and gradients against float64, at the timed shape."""
    leaves = [a for a in args if a.requires_grad]
    out = _outputs(case.triton_fn(*args))
    dys = [torch.randn_like(o) for o in out]
    grads = torch.autograd.grad(out, leaves, dys)
    ref_args = [a.detach().double().requires_grad_(a.requires_grad) for a in args]
    ref_out = _outputs(case.ref_fn(*ref_args))
    ref_grads = torch.autograd.grad(ref_out, [a for a in ref_args if a.requires_grad], [d.double() for d in dys])
    err = {"out": max(max_error(o, r) for o, r in zip(out, ref_out))}
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        err[f"grad{i}"] = max_error(g, r)
    err["finite"] = bool(all(torch.isfinite(t).all() for t in (*out, *grads)))
    return err, dys


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "out")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    ap.add_argument("--budget-s", type=float, default=90.0,
                    help="after this many seconds, skip the remaining torch.compile baselines")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--ops", default="", help="comma-separated subset of op names")
    ap.add_argument("--device", default="cuda",
                    help="'cpu' is a smoke test of this script (Triton interpreter, use with --small)")
    ap.add_argument("--small", action="store_true", help="tiny shapes, for a smoke test")
    args = ap.parse_args(argv)

    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("rowwise_gpu: no CUDA device here; nothing to time (this benchmark needs a GPU).")
        return 0
    if args.small:
        global M, N
        M, N = 64, 96
        ROPE.update(B=2, S=8, HQ=4, HK=2, D=16)
    import triton

    t_start = time.time()
    timer = make_timer(dev, args.reps, args.warmup)
    cli = " ".join(argv if argv is not None else sys.argv[1:])
    meta = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "shape": f"{M}x{N}", "rope": ROPE, "reps": args.reps,
        "command": f"python -m benchmarks.scripts.rowwise_gpu {cli}".strip(),
        "env": describe(dev),  # machine, versions, git commit: as in the harness's results
        "peers": {},  # a peer that is missing here, and why
    }
    print(f"rowwise_gpu: {meta['device']} torch {meta['torch']} triton {meta['triton']}", flush=True)
    rows, errors = [], []
    wanted = {o for o in args.ops.split(",") if o}
    copy_gbs_of = {}
    dnames = args.dtypes.split(",")
    for dname in dnames:
        dtype = getattr(torch, dname)
        src = torch.randn(M, N, device=dev).to(dtype)
        dst = torch.empty_like(src)
        copy = timer(lambda: dst.copy_(src))
        copy_gbs_of[dname] = 2 * src.numel() * src.element_size() / copy["median_ms"] / 1e6
        rows.append({"op": "copy", "dtype": dname, "mode": "fwd", "impl": "copy_", **copy,
                     "GB/s": copy_gbs_of[dname]})
        print(f"  copy {dname}: {copy['median_ms']:.3f} ms, {copy_gbs_of[dname]:.0f} GB/s", flush=True)
        del src, dst
    # the main ops in every dtype first: when the time budget runs out, the extras lose
    # their torch.compile baseline, not the main ones
    cases = _cases(dev)
    order = [c for c in cases if c.name not in _EXTRAS] + [c for c in cases if c.name in _EXTRAS]
    for case, dname in [(c, d) for c in order for d in dnames]:
        if wanted and case.name not in wanted:
            continue
        dtype = getattr(torch, dname)
        item = torch.empty(0, dtype=dtype).element_size()
        copy_gbs = copy_gbs_of[dname]
        try:
            inputs = case.make(dtype)
            err, dys = _verify(case, inputs)
            errors.append({"op": case.name, "dtype": dname, **err})
            impls = [("triton", case.triton_fn), ("eager", case.ref_fn)]
            try:
                peer = _liger(case.name)
                if peer is not None:
                    impls.append(("liger", peer))
            except Exception as e:  # not installed: reported, not fatal
                meta["peers"].setdefault("liger", f"missing ({type(e).__name__}: {e})"[:200])
            if not args.no_compile:
                if time.time() - t_start < args.budget_s:
                    impls.append(("compile", torch.compile(case.ref_fn, dynamic=False)))
                else:
                    print(f"  {case.name} {dname}: torch.compile skipped (time budget spent)", flush=True)
            res = {}
            for impl, fn in impls:
                for mode, elems, make_run in (("fwd", case.fwd_elems, lambda: _fwd(fn, inputs)),
                                              ("fwd+bwd", case.fwdbwd_elems, lambda: _fwdbwd(fn, inputs, dys))):
                    try:
                        t = timer(make_run())
                    except Exception as e:  # a baseline that fails (compile) must not stop the run
                        print(f"  {case.name} {dname} {impl} {mode}: FAILED {type(e).__name__}: {e}", flush=True)
                        continue
                    gbs = elems * item / t["median_ms"] / 1e6
                    row = {"op": case.name, "dtype": dname, "mode": mode, "impl": impl, **t, "GB/s": gbs,
                           "copy_fraction": gbs / copy_gbs}
                    res[(impl, mode)] = row
                    rows.append(row)
            for mode in ("fwd", "fwd+bwd"):
                tri = res.get(("triton", mode))
                if tri is None:
                    continue
                for base in ("eager", "compile", "liger"):
                    if (base, mode) in res:
                        tri[f"speedup_vs_{base}"] = res[(base, mode)]["median_ms"] / tri["median_ms"]
                print(f"  {case.name:22s} {dname:8s} {mode:7s} triton {tri['median_ms']:.3f} ms "
                      f"{tri['GB/s']:6.0f} GB/s ({100 * tri['copy_fraction']:.0f}% of copy)"
                      + "".join(f"  x{tri[k]:.2f} vs {k[11:]}" for k in ("speedup_vs_eager", "speedup_vs_compile",
                                                                          "speedup_vs_liger")
                                if k in tri), flush=True)
            del inputs, dys
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            # written after every case, so a run stopped by a timeout still leaves its results
            meta["seconds"] = time.time() - t_start
            _write(args.out, meta, rows, errors, quiet=True)
        except Exception as e:
            print(f"  {case.name} {dname}: FAILED {type(e).__name__}: {e}", flush=True)
            errors.append({"op": case.name, "dtype": dname, "failed": f"{type(e).__name__}: {e}"})
    meta["seconds"] = time.time() - t_start
    _write(args.out, meta, rows, errors)
    bad = [e for e in errors if e.get("failed") or not e.get("finite", True)]
    return 1 if bad else 0


def _write(out_dir, meta, rows, errors, quiet=False):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "rowwise_gpu.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "max_errors": errors}, f, indent=1)
    lines = [f"# Row-wise ops on {meta['device']}", "",
             f"torch {meta['torch']}, triton {meta['triton']}, Python {meta['python']}; {meta['shape']} "
             f"(RoPE {meta['rope']}); CUDA-event medians of {meta['reps']} calls, L2 flushed before each.", "",
             f"Command: `{meta['command']}` ({meta['seconds']:.0f} s)", "",
             f"Peers: {meta.get('peers') or 'liger available'}", "",
             "| op | dtype | mode | impl | median ms | p20 | p80 | GB/s | % of copy | vs eager | vs compile "
             "| vs liger |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        frac = f"{100 * r['copy_fraction']:.0f}%" if "copy_fraction" in r else ""
        ve = f"{r['speedup_vs_eager']:.2f}x" if "speedup_vs_eager" in r else ""
        vc = f"{r['speedup_vs_compile']:.2f}x" if "speedup_vs_compile" in r else ""
        vl = f"{r['speedup_vs_liger']:.2f}x" if "speedup_vs_liger" in r else ""
        lines.append(f"| {r['op']} | {r['dtype']} | {r['mode']} | {r['impl']} | {r['median_ms']:.3f} | "
                     f"{r['p20_ms']:.3f} | {r['p80_ms']:.3f} | {r['GB/s']:.0f} | {frac} | {ve} | {vc} | {vl} |")
    lines += ["", "## Max error of the Triton path against float64 at the timed shape", "",
              "| op | dtype | errors |", "|---|---|---|"]
    for e in errors:
        rest = {k: (f"{v:.2e}" if isinstance(v, float) else v) for k, v in e.items() if k not in ("op", "dtype")}
        lines.append(f"| {e['op']} | {e['dtype']} | {rest} |")
    with open(os.path.join(out_dir, "rowwise_gpu.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    if not quiet:
        print(f"rowwise_gpu: wrote {out_dir}/rowwise_gpu.json and rowwise_gpu.md", flush=True)


if __name__ == "__main__":
    sys.exit(main())
