"""C++ chunked gated delta rule (forward + backward) against transformers' torch_chunk_gated_delta_rule.

    python benchmarks/gdn_cpu.py            # B=2, T=4096, H=HV=8, K=V=128, fp32, qk-l2norm (~1-2 min)
    python benchmarks/gdn_cpu.py --quick    # T=1024 (< 20 s)

Before timing, both paths are checked against the float64 recurrence at a small shape.
Times are medians over --reps runs (forward, then backward of sum(o * do)). Peak memory is
the peak-RSS delta of one forward+backward in a fresh subprocess: the high-water mark
``VmHWM`` after the run minus the resident size ``VmRSS`` just before it (after a small
warm-up and with the inputs allocated; the high-water mark is reset there through
``/proc/self/clear_refs``), so it counts everything the op and its autograd graph allocate,
including temporaries freed before the end.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import twinkle_kernels as tk  # noqa: E402
from twinkle_kernels import _cpu_ext  # noqa: E402


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


def time_once(fn, ins, do):
    for t in ins:
        t.grad = None
    t0 = time.perf_counter()
    o = fn(ins)
    t1 = time.perf_counter()
    o.backward(do)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


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
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--peak-child", name,
                          "--shape", ",".join(map(str, shape))], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_delta"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="T=1024, fewer reps (< 20 s)")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--peak-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--shape", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.peak_child:
        B, T, H, K, V = map(int, a.shape.split(","))
        peak_child(a.peak_child, (B, T, H, K, V))
        return
    B, T, H, K, V = (2, 1024, 8, 128, 128) if a.quick else (2, 4096, 8, 128, 128)
    reps = a.reps or (2 if a.quick else 3)
    shape = (B, T, H, K, V)
    print(f"# gdn_cpu: B={B} T={T} H=HV={H} K={K} V={V} fp32 qk-l2norm, chunk 64, reps={reps}")
    print(f"# torch {torch.__version__}, threads {torch.get_num_threads()}, ISA {_cpu_ext.isa()}, "
          f"{platform.processor() or platform.machine()}")
    print(f"# verify (max abs error vs float64 recurrence, B=1 T=77 H=2 K=V=32): "
          + ", ".join(f"{k} {v:.2e}" for k, v in verify().items()))
    ins, do = make_inputs(*shape)
    times = {name: [] for name in RUNNERS}
    for name, fn in RUNNERS.items():
        fn(ins).backward(do)  # warm-up
    # Interleaved repetitions, so a change in machine load hits both paths alike.
    for _ in range(reps):
        for name, fn in RUNNERS.items():
            times[name].append(time_once(fn, ins, do))
    res = {}
    for name in RUNNERS:
        res[name] = {"fwd": statistics.median(t[0] for t in times[name]),
                     "bwd": statistics.median(t[1] for t in times[name]),
                     "peak": peak_memory(name, shape)}
    print("| path | fwd s (median) | bwd s (median) | fwd+bwd s | peak RSS delta MiB |")
    print("|---|---|---|---|---|")
    for name, r in res.items():
        print(f"| {name} | {r['fwd']:.3f} | {r['bwd']:.3f} | {r['fwd'] + r['bwd']:.3f} | {r['peak'] / 2**20:.0f} |")
    ours, base = res["twinkle_cpu"], res["transformers"]
    print(f"speed-up (transformers / twinkle_cpu): fwd {base['fwd'] / ours['fwd']:.2f}x, "
          f"bwd {base['bwd'] / ours['bwd']:.2f}x, fwd+bwd "
          f"{(base['fwd'] + base['bwd']) / (ours['fwd'] + ours['bwd']):.2f}x; "
          f"peak memory ratio (twinkle_cpu / transformers) {ours['peak'] / base['peak']:.2f}")


if __name__ == "__main__":
    main()
