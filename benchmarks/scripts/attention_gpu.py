"""Packed (THD) causal attention on a CUDA GPU: the varlen kernel against the per-sequence SDPA loop.

For packs of many short samples and of a few long ones (bf16, Qwen3 / Qwen3.5 head layouts) it
runs ``twinkle_kernels.packed_attention`` with the implementation
``select_packed_attention`` picks (flash-attn's or torch's ``varlen_attn``) and with
``impl="sdpa_loop"`` (one SDPA per sample, what the CPU runs), checks that they agree (output and
q / k / v gradients, relative max difference) and times both, forward and forward+backward.

Writes ``attention_gpu.json`` and ``attention_gpu.md`` to ``--out`` (default ``$OUT`` or ``./out``).
Without CUDA it prints why and exits 0; ``--device cpu --small`` is a smoke test of this script
(the loop only: the varlen kernels are CUDA-only, reported as missing).

    python -m benchmarks.scripts.attention_gpu
    python -m benchmarks.scripts.attention_gpu --device cpu --small --dtype float32   # smoke test
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch

from benchmarks.harness.env import describe
from benchmarks.harness.timing import time_fn
from twinkle_kernels.packed_attention import packed_attention, select_packed_attention

# (name, sample lengths, q heads, kv heads, head dim)
SHAPES = [
    ("64 x 128 tokens, Qwen3 heads", [128] * 64, 32, 8, 128),
    ("mixed 8192 tokens, Qwen3 heads", [1, 4000, 17, 2000, 1150, 1024], 32, 8, 128),
    ("64 x 128 tokens, Qwen3.5 heads", [128] * 64, 16, 4, 256),
]
SMALL_SHAPES = [("tiny pack", [5, 1, 9, 0, 3], 4, 2, 16)]


def _time(fn, device, reps):
    return time_fn(fn, device, warmup=2, min_reps=reps, max_reps=reps, budget_s=0.0).as_dict()


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


def _bench(name, lens, hq, hk, d, device, dtype, reps):
    cu = torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32)
    t = int(cu[-1])
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(t, h, d, device=device, generator=gen).to(dtype).requires_grad_()
               for h in (hq, hk, hk))
    do = torch.randn(t, hq, d, device=device, generator=gen).to(dtype)
    scale = d ** -0.5
    choice = select_packed_attention(device, dtype, d, hq, hk)
    shape = {"name": name, "tokens": t, "samples": len(lens), "Hq": hq, "Hkv": hk, "D": d}
    impls = {"sdpa_loop": "sdpa_loop"}
    rows = []
    if choice.impl != "sdpa_loop":
        impls = {choice.impl: choice.impl, **impls}
    else:
        rows.append({**shape, "impl": "varlen", "status": "missing", "reason": choice.reason})
    outs = {}
    for label, impl in impls.items():
        row = {**shape, "impl": label, "status": "ok"}
        try:
            o = packed_attention(q, k, v, cu, scale=scale, impl=impl)
            outs[label] = (o.detach(), torch.autograd.grad(o, (q, k, v), do))

            def fwd():
                with torch.no_grad():
                    return packed_attention(q, k, v, cu, scale=scale, impl=impl)

            def fwd_bwd():
                torch.autograd.grad(packed_attention(q, k, v, cu, scale=scale, impl=impl), (q, k, v), do)

            row["fwd"] = _time(fwd, device, reps)
            row["fwd_bwd"] = _time(fwd_bwd, device, reps)
        except Exception as e:  # a kernel that refuses the call is reported with its reason
            row = {**shape, "impl": label, "status": "error", "reason": f"{type(e).__name__}: {e}"[:300]}
        rows.append(row)
    if choice.impl != "sdpa_loop" and choice.impl in outs and "sdpa_loop" in outs:
        (o, g), (o_ref, g_ref) = outs[choice.impl], outs["sdpa_loop"]
        row = next(r for r in rows if r["impl"] == choice.impl)
        row["rel_max_diff_vs_loop"] = {"out": _rel(o, o_ref), "dq": _rel(g[0], g_ref[0]),
                                       "dk": _rel(g[1], g_ref[1]), "dv": _rel(g[2], g_ref[2])}
        loop = next(r for r in rows if r["impl"] == "sdpa_loop")
        if loop["status"] == "ok" and row["status"] == "ok":
            row["speedup_vs_loop"] = {m: loop[m]["median_ms"] / row[m]["median_ms"] for m in ("fwd", "fwd_bwd")}
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="one tiny pack, for a smoke test")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.getcwd(), "out"))
    args = ap.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("attention_gpu: no CUDA device here; nothing to check (this script needs a GPU).")
        return 0
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "dtype": str(dtype), "env": describe(device)}
    rows = []
    for shape in SMALL_SHAPES if args.small else SHAPES:
        rows += _bench(*shape, device=device, dtype=dtype, reps=2 if args.small else args.reps)
        for r in rows[-2:]:
            print(json.dumps(r), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "attention_gpu.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = [f"# Packed causal attention on {meta['device']} ({dtype})", "", f"torch {meta['torch']}", "",
             "| pack | Hq/Hkv/D | impl | fwd ms | fwd+bwd ms | vs loop (fwd / fwd+bwd) | rel diff vs loop |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {r['name']} ({r['tokens']} tokens, {r['samples']} samples) | {r['Hq']}/{r['Hkv']}/{r['D']} | {r['impl']} |"
        if r["status"] != "ok":
            lines.append(f"{head} {r['status']} | | | {r.get('reason', '')[:80]} |")
            continue
        sp = r.get("speedup_vs_loop")
        diff = r.get("rel_max_diff_vs_loop")
        lines.append(f"{head} {r['fwd']['median_ms']:.3f} | {r['fwd_bwd']['median_ms']:.3f} | "
                     + (f"{sp['fwd']:.1f}x / {sp['fwd_bwd']:.1f}x" if sp else "") + " | "
                     + (", ".join(f"{k} {v:.1e}" for k, v in diff.items()) if diff else "") + " |")
    with open(os.path.join(args.out, "attention_gpu.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    # a varlen kernel that disagrees with the loop beyond bf16 rounding is a failure of this check
    bad = [r for r in rows if r.get("status") == "error"
           or any(v > 5e-2 for v in (r.get("rel_max_diff_vs_loop") or {}).values())]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
