"""CPU benchmark of the MoE experts: ``tk.moe_experts`` against transformers' own implementations.

Forward + backward (gradients for the hidden states, both expert weights and the routing
weights) of one experts layer at T tokens, hidden H, expert width I, E experts, top-k:

- ``twinkle``         : ``twinkle_kernels.moe_experts(..., backend="cpu")`` (C++ grouped matmul);
- ``hf-eager``        : ``Qwen3MoeExperts`` with ``experts_implementation="eager"`` (a loop over experts);
- ``hf-grouped_mm``   : the same module with ``experts_implementation="grouped_mm"`` (``torch._grouped_mm``).

A second table times the grouped matmul alone (the gate_up shape, forward) for the
``torch._grouped_mm`` rule in ``twinkle_kernels/moe/_cpu.py``: the C++ op, ``torch._grouped_mm``
and a Python loop of ``torch.mm`` per expert.

The machine is shared (2 cores, several users): every figure is a median (with p20 / p80)
over repetitions, implementations run round-robin so load hits them alike, and the load
average is printed with the results. Correctness is checked before timing.

    python -m benchmarks.scripts.moe_cpu            # T=4096 H=1024 I=512 E=64 top-8, fp32 + bf16; writes results
    python -m benchmarks.scripts.moe_cpu --quick    # small shapes, < 20 s, prints only
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform

import torch

import twinkle_kernels as tk
from benchmarks.harness import timing
from twinkle_kernels import registry

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _experts_module(h, i, e, k, impl, dtype):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=i, num_experts=e, num_experts_per_tok=k,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, vocab_size=32)
    cfg._experts_implementation = impl
    return Qwen3MoeExperts(cfg).to(dtype)


def _inputs(t, h, i, e, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    probs = torch.softmax(torch.randn(t, e, generator=g), -1)
    wts, idx = torch.topk(probs, k, dim=-1)
    wts = (wts / wts.sum(-1, keepdim=True)).to(dtype)
    gu = (torch.randn(e, 2 * i, h, generator=g) / h ** 0.5).to(dtype)
    dp = (torch.randn(e, h, i, generator=g) / i ** 0.5).to(dtype)
    dy = torch.randn(t, h, generator=g).to(dtype)
    return x, idx, wts, gu, dp, dy


def _make_runs(t, h, i, e, k, dtype):
    x, idx, wts, gu, dp, dy = _inputs(t, h, i, e, k, dtype)
    runs = {}
    for impl in ("eager", "grouped_mm"):
        mod = _experts_module(h, i, e, k, impl, dtype)
        with torch.no_grad():
            mod.gate_up_proj.copy_(gu)
            mod.down_proj.copy_(dp)
        runs[f"hf-{impl}"] = (mod, (lambda m: lambda xx, ww: m(xx, idx, ww))(mod))
    params = [gu.clone().requires_grad_(), dp.clone().requires_grad_()]
    runs["twinkle"] = (params, lambda xx, ww: tk.moe_experts(xx, idx, ww, params[0], params[1], backend="cpu"))

    def step(name):
        holder, fn = runs[name]
        xx = x.clone().requires_grad_()
        ww = wts.clone().requires_grad_()
        out = fn(xx, ww)
        out.backward(dy)
        ps = holder.parameters() if isinstance(holder, torch.nn.Module) else holder
        grads = [xx.grad, ww.grad] + [p.grad for p in ps]
        for p in (holder.parameters() if isinstance(holder, torch.nn.Module) else holder):
            p.grad = None
        return out.detach(), grads

    return {name: (lambda n: lambda: step(n))(name) for name in runs}


def _check(runs, dtype):
    """All implementations agree (bf16: within a few bf16 ulps of the output scale) before timing."""
    outs = {name: fn() for name, fn in runs.items()}
    ref_out, ref_grads = outs["hf-eager"]
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for name, (out, grads) in outs.items():
        errs = [(out.double() - ref_out.double()).abs().max().item()]
        errs += [((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()
                 for a, b in zip(grads, ref_grads)]
        worst = max(errs)
        if worst > tol * max(1.0, ref_out.abs().max().item()):
            raise SystemExit(f"{name} disagrees with hf-eager: max errors {errs}")


def _time_round_robin(fns, reps):
    """Seconds per call of each of ``fns``: ``reps`` rounds of one run each, in turn (the harness's
    ``time_interleaved``; callers warm up first). Returns ``{name: (median, p20, p80)}``."""
    timings, errors = timing.time_interleaved(fns, torch.device("cpu"),
                                              dict(warmup=0, min_reps=reps, max_reps=reps, budget_s=0.0), reps)
    if errors:
        raise SystemExit("; ".join(f"{n} failed: {type(e).__name__}: {e}" for n, e in errors.items()))
    return {n: (t.median_ms / 1e3, t.p20_ms / 1e3, t.p80_ms / 1e3) for n, t in timings.items()}


def _gmm_runs(m, kdim, n, e, dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(m, kdim, generator=g).to(dtype)
    w = (torch.randn(e, n, kdim, generator=g) / kdim ** 0.5).to(dtype).transpose(1, 2)  # HF layout view
    counts = torch.bincount(torch.randint(0, e, (m,), generator=g), minlength=e)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    out = torch.empty(m, n, dtype=dtype)
    ends = offs.tolist()

    def loop():
        s = 0
        for j, end in enumerate(ends):
            if end > s:
                torch.mm(x[s:end], w[j], out=out[s:end])
            s = end

    return {"cpu-op": lambda: registry.cpu_kernels().grouped_mm_fwd(x, w, offs, out),
            "torch._grouped_mm": lambda: torch._grouped_mm(x, w, offs=offs),
            "loop-mm": loop}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small shapes, few repetitions, no results file")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--out", default=None, help="results markdown (default benchmarks/results/moe_cpu_<date>.md)")
    args = ap.parse_args(argv)
    why = registry.backend_status("cpu")
    if why:
        raise SystemExit(f"the cpu backend is not built: {why}")
    t, h, i, e, k = (256, 128, 64, 8, 2) if args.quick else (4096, 1024, 512, 64, 8)
    reps = args.reps or 3
    flops = 3 * 2 * (t * k) * (h * 2 * i + i * h)  # fwd + 2x for bwd, both projections
    lines = []
    say = lambda s="": (print(s), lines.append(s))  # noqa: E731
    say(f"MoE experts fwd+bwd: T={t} H={h} I={i} E={e} top-{k}; {reps} reps round-robin after a correctness check that warms up")
    say(f"torch {torch.__version__}, {torch.get_num_threads()} threads, ISA {registry.cpu_isa()}, "
        f"{platform.processor() or platform.machine()}, load average at start {os.getloadavg()}")
    say()
    say("| dtype | impl | median s | p20 s | p80 s | GFLOP/s | speed-up of twinkle |")
    say("|---|---|---|---|---|---|---|")
    for dname, dtype in DTYPES.items():
        runs = _make_runs(t, h, i, e, k, dtype)
        _check(runs, dtype)  # also the warm-up of every implementation
        stats = _time_round_robin(runs, reps)
        med = {n: st[0] for n, st in stats.items()}
        for n, (m_, p20, p80) in stats.items():
            sp = "-" if n == "twinkle" else f"{m_ / med['twinkle']:.2f}x"
            say(f"| {dname} | {n} | {m_:.3f} | {p20:.3f} | {p80:.3f} | {flops / m_ / 1e9:.1f} | {sp} |")
    say()
    m_rows = t * k
    say(f"grouped matmul alone (gate_up: M={m_rows}, K={h}, N={2 * i}, E={e}, HF-layout weight view), forward")
    say()
    say("| dtype | impl | median s | p20 s | p80 s | GFLOP/s |")
    say("|---|---|---|---|---|---|")
    for dname, dtype in DTYPES.items():
        gmm = _gmm_runs(m_rows, h, 2 * i, e, dtype)
        for fn in gmm.values():  # warm-up
            fn()
        for n, (m_, p20, p80) in _time_round_robin(gmm, reps).items():
            say(f"| {dname} | {n} | {m_:.3f} | {p20:.3f} | {p80:.3f} | {2 * m_rows * h * 2 * i / m_ / 1e9:.1f} |")
    say()
    say(f"load average at end {os.getloadavg()}")
    if not args.quick:
        path = args.out or os.path.join(ROOT, "benchmarks", "results",
                                        f"moe_cpu_{datetime.date.today().isoformat()}.md")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write("# MoE experts on the CPU\n\nCommand: `python -m benchmarks.scripts.moe_cpu`\n\n")
            f.write("\n".join(lines) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
