"""CPU bar of the fused linear cross-entropy: time and whole-process peak memory of one forward +
backward of the LM head and its loss, against eager ``F.linear`` + ``F.cross_entropy``; with
``--mode nograd``, of the forward alone under ``torch.no_grad`` (the inputs still require grad, as a
model's parameters do in evaluation).

Two eager providers: ``eager`` runs the loss in the input dtype; ``eager-fp32-loss`` upcasts the
logits to fp32 first, as transformers' ``ForCausalLMLoss`` does (what Hugging Face users run).
torch's CPU cross entropy in bf16 reduces the per-row losses in a bf16 accumulator, which stops
growing once the sum passes a few thousand (4096 + 12.4 rounds back to 4096), so plain eager's bf16
mean loss is wrong at N=4096; its time and memory are still those of the eager step. Each run's
loss is compared with the float64 loss of the same inputs (computed once, in a separate process,
vocabulary block by vocabulary block; ``--no-reference`` skips it).

Each provider runs in a fresh process (so nothing one leaves behind, caching allocators or
freed-but-mapped pages, counts against the next). Peak memory is the process's peak resident
set (``VmHWM``, reset through ``/proc/self/clear_refs`` after the inputs are built) minus the
resident set at that point: every byte the step touched, scratch memory of C++ kernels and
BLAS included, the same way for every provider.

    python -m benchmarks.scripts.linear_ce_cpu --n 4096 --h 2560 --v 151936 --dtype float32
    python -m benchmarks.scripts.linear_ce_cpu --n 256 --h 256 --v 4096 --reps 2   # smoke
    python -m benchmarks.scripts.linear_ce_cpu --dtype bfloat16 --rounds 3   # interleaved, median ratio
    python -m benchmarks.scripts.linear_ce_cpu --mode nograd --rounds 3      # the forward alone
    python -m benchmarks.scripts.linear_ce_cpu --frozen-weight               # LoRA's head: no weight gradient

Prints a markdown table and writes it, with the command, to ``--out`` when given.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

PROVIDERS = ("eager", "eager-fp32-loss", "twinkle-cpu", "compile")


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _inputs(args):
    import torch

    torch.manual_seed(0)
    dt = getattr(torch, args.dtype)
    h = (torch.randn(args.n, args.h)).to(dt).requires_grad_(True)
    w = (torch.randn(args.v, args.h) * args.h ** -0.5).to(dt).requires_grad_(not getattr(args, "frozen_weight", False))
    y = torch.randint(0, args.v, (args.n,))
    y[::8] = -100
    return h, w, y


def _reference_loss(args, block=8192) -> float:
    """The mean loss of the benchmark's inputs in float64: an online logsumexp over vocabulary
    blocks, so no [N, V] float64 logits (or float64 copy of the weight) exist at once."""
    import torch

    h, w, y = _inputs(args)
    h, w = h.detach().double(), w.detach()
    m = torch.full((args.n,), -float("inf"), dtype=torch.float64)
    s = torch.zeros(args.n, dtype=torch.float64)
    zy = torch.zeros(args.n, dtype=torch.float64)
    valid = y != -100
    for v0 in range(0, args.v, block):
        z = h @ w[v0:v0 + block].double().T
        mb = torch.maximum(m, z.max(1).values)
        s = s * torch.exp(m - mb) + torch.exp(z - mb[:, None]).sum(1)
        m = mb
        here = valid & (y >= v0) & (y < v0 + z.shape[1])
        zy[here] = z[here.nonzero().squeeze(1), y[here] - v0]
    return float(((m + s.log() - zy)[valid]).mean())


def _child(args) -> dict:
    import torch
    import torch.nn.functional as F

    import twinkle_kernels as tk

    h, w, y = _inputs(args)

    if args.provider == "eager":
        def step():
            return F.cross_entropy(F.linear(h, w), y)
    elif args.provider == "eager-fp32-loss":
        def step():  # transformers' ForCausalLMLoss: logits.float() before cross_entropy
            return F.cross_entropy(F.linear(h, w).float(), y)
    elif args.provider == "compile":
        fn = torch.compile(lambda a, b: F.cross_entropy(F.linear(a, b), y), dynamic=False)

        def step():
            return fn(h, w)
    else:
        def step():
            return tk.fused_linear_cross_entropy(h, w, y, backend="cpu")

    def run():
        h.grad = w.grad = None
        if args.mode == "nograd":
            with torch.no_grad():
                return step()
        loss = step()
        loss.backward()
        return loss

    if args.provider == "compile":
        run()  # compile outside the measurement
    h.grad = w.grad = None
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _rss("VmRSS")
    times, cpus = [], []
    for _ in range(args.reps):
        t0, c0 = time.perf_counter(), time.process_time()
        loss = run()
        times.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    peak = _rss("VmHWM") - base
    return {"provider": args.provider, "loss": float(loss), "time_s": min(times), "times": times,
            "cpu_s": min(cpus), "peak_bytes": peak}


def _median(xs):
    xs = sorted(xs)
    k = len(xs) // 2
    return xs[k] if len(xs) % 2 else (xs[k - 1] + xs[k]) / 2


def _table(args, provs, runs, ref=None) -> str:
    ok = {p: [r for r in rs if "error" not in r] for p, rs in runs.items()}
    eager = ok.get("eager") or []
    ref_txt = f"; loss err: |loss - float64 loss| (float64 loss {ref:.6f})" if ref is not None else ""
    mode = getattr(args, "mode", "fwd+bwd") + (", frozen weight" if getattr(args, "frozen_weight", False) else "")
    lines = [f"{mode}, N={args.n} H={args.h} V={args.v} {args.dtype}, best of {args.reps} per process, "
             f"{args.rounds} interleaved round(s); time: median over rounds; x eager time: median of the "
             f"per-round ratios; load: 1-min load average at each start{ref_txt}; cpu s: the step's process CPU "
             "time (all threads; less sensitive than wall time to other users of the cores), median over rounds",
             "", "| provider | time s | x eager time | peak MiB | x eager peak | loss | load | loss err | cpu s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for prov in provs:
        rs = ok[prov]
        if not rs:
            err = runs[prov][-1]["error"]
            lines.append(f"| {prov} | failed: {err.splitlines()[-1] if err else '?'} | | | | | | | |")
            continue
        t = _median([r["time_s"] for r in rs])
        ratios = [r["time_s"] / e["time_s"] for r, e in zip(rs, eager)]
        tr = f"{_median(ratios):.2f}" if ratios else "-"
        peak = max(r["peak_bytes"] for r in rs)
        epeak = max((e["peak_bytes"] for e in eager), default=0)
        mr = f"{peak / epeak:.3f}" if epeak else "-"
        loads = "/".join(f"{r['load']:.1f}" for r in rs)
        lerr = f"{abs(rs[-1]['loss'] - ref):.2e}" if ref is not None else "-"
        cpu = [r["cpu_s"] for r in rs if "cpu_s" in r]
        ctxt = f"{_median(cpu):.2f}" if cpu else "-"
        lines.append(f"| {prov} | {t:.2f} | {tr} | {peak / 2**20:.0f} | {mr} | {rs[-1]['loss']:.6f} | {loads} "
                     f"| {lerr} | {ctxt} |")
    for base in ("eager", "eager-fp32-loss"):
        bs = ok.get(base) or []
        if len(bs) > 1 or (base != "eager" and bs):
            for prov in provs:
                if prov != base and ok[prov] and not (base == "eager-fp32-loss" and prov == "eager"):
                    per = ", ".join(f"{r['time_s']:.1f}/{e['time_s']:.1f}" for r, e in zip(ok[prov], bs))
                    cr = [r["cpu_s"] / e["cpu_s"] for r, e in zip(ok[prov], bs) if "cpu_s" in r and "cpu_s" in e]
                    ctxt = f"; cpu-time ratios {', '.join(f'{x:.2f}' for x in cr)}" if cr else ""
                    ratios = [r["time_s"] / e["time_s"] for r, e in zip(ok[prov], bs)]
                    pk = max(r["peak_bytes"] for r in ok[prov]) / max(e["peak_bytes"] for e in bs)
                    lines.append(f"\n{prov} / {base} seconds per round: {per} (ratios "
                                 f"{', '.join(f'{x:.2f}' for x in ratios)}; median {_median(ratios):.2f}; "
                                 f"peak ratio {pk:.3f}{ctxt})")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--h", type=int, default=2560)
    p.add_argument("--v", type=int, default=151936)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--mode", default="fwd+bwd", choices=("fwd+bwd", "nograd"),
                   help="what is timed: forward + backward, or the forward alone under torch.no_grad")
    p.add_argument("--providers", default="eager,twinkle-cpu")
    p.add_argument("--frozen-weight", action="store_true",
                   help="the weight does not require grad (LoRA's LM head, a frozen tied embedding): no weight gradient")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the providers interleaved this many times (fresh processes each); the table gives "
                        "the median time and the median of the per-round time ratios to eager")
    p.add_argument("--no-reference", action="store_true", help="skip the float64 reference loss")
    p.add_argument("--provider", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.provider == "fp64-reference":
        print("RESULT " + json.dumps({"loss": _reference_loss(args)}))
        return 0
    if args.provider:
        print("RESULT " + json.dumps(_child(args)))
        return 0
    provs = args.providers.split(",")
    for prov in provs:
        if prov not in PROVIDERS:
            raise SystemExit(f"unknown provider {prov!r}; expected {PROVIDERS}")
    runs = {prov: [] for prov in provs}  # per provider, one result per round
    for _ in range(args.rounds):
        for prov in provs:
            cmd = [sys.executable, "-m", "benchmarks.scripts.linear_ce_cpu", "--provider", prov, "--n", str(args.n),
                   "--h", str(args.h), "--v", str(args.v), "--dtype", args.dtype, "--reps", str(args.reps),
                   "--mode", args.mode] + (["--frozen-weight"] if args.frozen_weight else [])
            load = os.getloadavg()[0]
            res = subprocess.run(cmd, capture_output=True, text=True)
            line = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
            if res.returncode or not line:
                runs[prov].append({"provider": prov, "error": (res.stderr or res.stdout)[-300:]})
            else:
                runs[prov].append(dict(json.loads(line[-1][7:]), load=load))
    ref = None
    if not args.no_reference:
        cmd = [sys.executable, "-m", "benchmarks.scripts.linear_ce_cpu", "--provider", "fp64-reference", "--n",
               str(args.n), "--h", str(args.h), "--v", str(args.v), "--dtype", args.dtype]
        res = subprocess.run(cmd, capture_output=True, text=True)
        line = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
        ref = json.loads(line[-1][7:])["loss"] if line and not res.returncode else None
    text = _table(args, provs, runs, ref)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "a") as f:
            f.write(f"\n## {datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC\n\n`python -m benchmarks.scripts.linear_ce_cpu "
                    f"{' '.join(argv if argv is not None else sys.argv[1:])}`\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
