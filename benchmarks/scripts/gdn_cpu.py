"""C++ chunked gated delta rule (forward + backward) against transformers' torch_chunk_gated_delta_rule.

    python -m benchmarks.scripts.gdn_cpu            # B=2, T=4096, H=HV=8, K=V=128, fp32, qk-l2norm (~1-2 min)
    python -m benchmarks.scripts.gdn_cpu --quick    # T=1024 (< 20 s)

Before timing, both paths are checked against the float64 recurrence at a small shape.
Times are medians over --reps runs of the forward and of the backward of sum(o * do) on a
retained graph (the harness's ``timing.time_fn``), one run of each in turn per round;
forward+backward is the sum of the two medians. Wall time and process CPU time (all threads) are both reported,
the latter being the steadier figure on a shared machine. Peak memory is
the peak-RSS delta of one forward+backward in a fresh subprocess: the high-water mark
``VmHWM`` after the run minus the resident size ``VmRSS`` just before it (after a small
warm-up and with the inputs allocated; the high-water mark is reset there through
``/proc/self/clear_refs``), so it counts everything the op and its autograd graph allocate,
including temporaries freed before the end.
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys

import torch
import torch.nn.functional as F

import twinkle_kernels as tk
from benchmarks.harness import timing
from benchmarks.harness.env import ROOT, child_env
from twinkle_kernels import registry


def _baseline():
    from transformers.models.qwen3_next import modeling_qwen3_next as m
    return m.torch_chunk_gated_delta_rule


def make_inputs(B, T, H, K, V, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen, dtype=dtype)
    k = torch.randn(B, T, H, K, generator=gen, dtype=dtype)
    v = torch.randn(B, T, H, V, generator=gen, dtype=dtype)
    g = F.logsigmoid(torch.randn(B, T, H, generator=gen, dtype=dtype) + 2.0)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen, dtype=dtype))
    do = torch.randn(B, T, H, V, generator=gen, dtype=dtype)
    return [t.requires_grad_(True) for t in (q, k, v, g, beta)], do


def run_ours(ins):
    return tk.chunk_gated_delta_rule(*ins, use_qk_l2norm_in_kernel=True, backend="cpu")[0]


def run_hf(ins):
    return _baseline()(*ins, use_qk_l2norm_in_kernel=True)[0]


RUNNERS = {"twinkle_cpu": run_ours, "transformers": run_hf}


def verify():
    """Both paths match the float64 recurrence (output and gradients) at a small shape."""
    ins, do = make_inputs(1, 77, 2, 32, 32, seed=1, dtype=torch.float64)
    o_ref = tk.chunk_gated_delta_rule(*ins, use_qk_l2norm_in_kernel=True, backend="reference")[0]
    g_ref = torch.autograd.grad((o_ref * do).sum(), ins)
    worst = {}
    for name, fn in RUNNERS.items():
        ins32 = [t.detach().float().requires_grad_(True) for t in ins]
        o = fn(ins32)
        grads = torch.autograd.grad((o * do.float()).sum(), ins32)
        errs = [(o.double() - o_ref).abs().max().item()]
        errs += [(a.double() - b).abs().max().item() for a, b in zip(grads, g_ref)]
        worst[name] = max(errs)
        if worst[name] > 1e-3:
            raise SystemExit(f"{name} disagrees with the float64 recurrence: max abs error {worst[name]:.3g}")
    return worst


def passes(fn, ins, do):
    """The two timed callables of one path: the forward (autograd graph recorded, as in training)
    and the backward of ``sum(o * do)`` on a graph recorded once and retained (gradients
    returned, not accumulated), as the harness's ``bwd`` mode."""
    o = fn(ins)

    def fwd():
        return fn(ins)

    def bwd():
        return torch.autograd.grad(o, ins, do, retain_graph=True)
    return {"fwd": fwd, "bwd": bwd}


def _status_bytes(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak():
    # Linux >= 4.0: writing 5 to clear_refs resets VmHWM to the current RSS.
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # VmHWM then counts from exec; the warm-up below is small


def peak_child(name, shape):
    """Runs in a fresh process: peak RSS delta of one forward+backward."""
    # A small warm-up first, so one-time library set-up (BLAS buffers, thread pools) is not counted.
    wins, wdo = make_inputs(1, 128, 2, shape[3], shape[4])
    RUNNERS[name](wins).backward(wdo)
    del wins, wdo
    ins, do = make_inputs(*shape)
    _reset_peak()
    before = _status_bytes("VmRSS")
    o = RUNNERS[name](ins)
    o.backward(do)
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over fork + exec from the (large) parent.
    print(json.dumps({"peak_delta": _status_bytes("VmHWM") - before}))


def peak_memory(name, shape):
    out = subprocess.run([sys.executable, "-m", "benchmarks.scripts.gdn_cpu", "--peak-child", name,
                          "--shape", ",".join(map(str, shape))], cwd=ROOT, env=child_env(), capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_delta"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="T=1024, fewer reps (< 20 s)")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--peak-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--shape", default=None, help="B,T,H,K,V instead of the default shape (e.g. 1,128,2,32,32 "
                                                 "for a smoke test)")
    a = p.parse_args(argv)
    if a.peak_child:
        B, T, H, K, V = map(int, a.shape.split(","))
        peak_child(a.peak_child, (B, T, H, K, V))
        return
    B, T, H, K, V = (2, 1024, 8, 128, 128) if a.quick else (2, 4096, 8, 128, 128)
    if a.shape:
        B, T, H, K, V = map(int, a.shape.split(","))
    reps = a.reps or (2 if a.quick else 3)
    shape = (B, T, H, K, V)
    print(f"# gdn_cpu: B={B} T={T} H=HV={H} K={K} V={V} fp32 qk-l2norm, chunk 64, reps={reps}")
    print(f"# torch {torch.__version__}, threads {torch.get_num_threads()}, ISA {registry.cpu_isa()}, "
          f"{platform.processor() or platform.machine()}")
    print(f"# verify (max abs error vs float64 recurrence, B=1 T=77 H=2 K=V=32): "
          + ", ".join(f"{k} {v:.2e}" for k, v in verify().items()))
    ins, do = make_inputs(*shape)
    fns = {(name, p): f for name, fn in RUNNERS.items() for p, f in passes(fn, ins, do).items()}
    for f in fns.values():  # warm-up
        f()
    # One run of each (path, pass) per round, in turn, so a change in machine load hits both paths alike.
    timed, errors = timing.time_interleaved(fns, torch.device("cpu"),
                                            dict(warmup=0, min_reps=reps, max_reps=reps, budget_s=0.0), reps)
    if errors:
        raise SystemExit("; ".join(f"{k} failed: {type(e).__name__}: {e}" for k, e in errors.items()))
    res = {}
    for name in RUNNERS:
        f, b = timed[(name, "fwd")], timed[(name, "bwd")]
        res[name] = {"fwd": f.median_ms / 1e3, "bwd": b.median_ms / 1e3,  # seconds
                     "fwd_cpu": f.cpu.median_ms / 1e3, "bwd_cpu": b.cpu.median_ms / 1e3}
        res[name]["peak"] = peak_memory(name, shape)
    print("| path | fwd s | bwd s | fwd+bwd s | fwd CPU s | bwd CPU s | fwd+bwd CPU s | peak RSS delta MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in res.items():
        print(f"| {name} | {r['fwd']:.3f} | {r['bwd']:.3f} | {r['fwd'] + r['bwd']:.3f} | {r['fwd_cpu']:.3f} | "
              f"{r['bwd_cpu']:.3f} | {r['fwd_cpu'] + r['bwd_cpu']:.3f} | {r['peak'] / 2**20:.0f} |")
    ours, base = res["twinkle_cpu"], res["transformers"]
    print(f"speed-up (transformers / twinkle_cpu): fwd {base['fwd'] / ours['fwd']:.2f}x, "
          f"bwd {base['bwd'] / ours['bwd']:.2f}x, fwd+bwd "
          f"{(base['fwd'] + base['bwd']) / (ours['fwd'] + ours['bwd']):.2f}x (wall); fwd+bwd CPU time "
          f"{(base['fwd_cpu'] + base['bwd_cpu']) / (ours['fwd_cpu'] + ours['bwd_cpu']):.2f}x; "
          f"peak memory ratio (twinkle_cpu / transformers) {ours['peak'] / base['peak']:.2f}")


if __name__ == "__main__":
    main()
