"""GPU benchmark of the Triton grouped matmul and moe_experts (run on a CUDA machine).

For the MoE shape (T tokens, top-k, E experts, H, I) it checks the Triton grouped matmul
against the float64 reference, then times, with CUDA events, in one run:

- ``triton``             : ``tk.grouped_matmul(..., backend="triton")``;
- ``torch._grouped_mm``  : where this torch has it for the dtype;
- transformers' ``grouped_mm`` experts function (``ALL_EXPERTS_FUNCTIONS["grouped_mm"]`` on a
  Qwen3-MoE experts module with the same weights) against ``moe_experts(backend="triton")``,
  forward+backward, where this transformers has it;
- ``dense mm``           : one ``torch.mm`` of the same FLOPs ([S, K] @ [K, N]), the roofline
                           the grouped kernels are compared with;

for the forward and forward+backward, and ``moe_experts`` (triton) forward+backward.
TFLOP/s and the fraction of the dense matmul's TFLOP/s are printed.

    python -m benchmarks.scripts.moe_gpu [--tokens 4096 --hidden 2048 --inter 768 --experts 64 --topk 8]
    # smoke test (Triton interpreter, tiny shapes, one timed call per timing, no warm-up):
    TRITON_INTERPRET=1 python -m benchmarks.scripts.moe_gpu --device cpu --small --dtypes float32 --reps 1 --warmup 0

Writes ``moe_gpu.json`` and ``moe_gpu.md`` to ``--out`` (default ``$OUT`` or ``./out``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch

import twinkle_kernels as tk
from benchmarks.harness.env import describe
from benchmarks.harness.timing import time_fn
from twinkle_kernels.moe import grouped_matmul_reference


SMALL = dict(tokens=40, hidden=24, inter=20, experts=4, topk=2)  # --small: a smoke test of this script


def _time(fn, device, reps, warmup):
    """Median seconds of ``fn`` over exactly ``reps`` runs after ``warmup`` untimed ones (the harness's
    timing; CUDA events on a GPU)."""
    return time_fn(fn, device, warmup=warmup, min_reps=reps, max_reps=reps, budget_s=0.0).median_ms / 1e3


def _fwd_bwd(f, x, w, dy):
    def run():
        xx = x.detach().requires_grad_()
        ww = w.detach().requires_grad_()
        f(xx, ww).backward(dy)
    return run


def _hf_grouped_mm_experts(gate_up_proj, down_proj, top_k):
    """transformers' ``grouped_mm`` experts function on a Qwen3-MoE experts module holding the same
    weights: ``fn(hidden_states, top_k_index, top_k_weights)``."""
    from transformers import Qwen3MoeConfig
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    e, two_i, h = gate_up_proj.shape
    cfg = Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=two_i // 2, num_experts=e,
                         num_experts_per_tok=top_k, intermediate_size=two_i // 2)
    with torch.device("meta"):
        mod = Qwen3MoeExperts(cfg)
    mod.gate_up_proj = torch.nn.Parameter(gate_up_proj.detach(), requires_grad=True)
    mod.down_proj = torch.nn.Parameter(down_proj.detach(), requires_grad=True)
    fn = ALL_EXPERTS_FUNCTIONS["grouped_mm"]
    return lambda x, idx, w: fn(mod, x, idx, w)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls before each timing (default 3)")
    ap.add_argument("--device", default="cuda",
                    help="'cpu' is a smoke test of this script (Triton interpreter, use with --small)")
    ap.add_argument("--small", action="store_true", help=f"tiny shapes {SMALL}, for a smoke test")
    ap.add_argument("--out", default=os.environ.get("OUT") or "out")
    args = ap.parse_args(argv)
    if args.reps < 1 or args.warmup < 0:
        ap.error(f"--reps must be at least 1 and --warmup at least 0, got {args.reps} and {args.warmup}")
    if args.small:
        for key, val in SMALL.items():
            setattr(args, key, val)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("moe_gpu: no CUDA device here; nothing to time (this benchmark needs a GPU).")
        return 0
    t, h, i, e, k = args.tokens, args.hidden, args.inter, args.experts, args.topk
    s = t * k
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu"
    meta = {"device": name, "torch": torch.__version__, "python": platform.python_version(),
            "shape": dict(T=t, H=h, I=i, E=e, topk=k, S=s), "reps": args.reps,
            "env": describe(dev)}  # machine, versions, git commit: as in the harness's results
    print(f"{name} torch {torch.__version__}; T={t} H={h} I={i} E={e} top-{k} (S={s})")
    g = torch.Generator(device="cpu").manual_seed(0)
    idx = torch.topk(torch.rand(t, e, generator=g), k, dim=-1).indices.to(dev)
    plan = tk.moe.make_routing_plan(idx, e)
    rows, lines = [], [f"# MoE grouped matmul on {name}", "",
                       f"torch {meta['torch']}; T={t} H={h} I={i} E={e} top-{k} (S={s} routed rows); "
                       f"medians of {args.reps} calls", ""]
    for dname in args.dtypes.split(","):
        dtype = getattr(torch, dname)
        # the gate_up projection: [S, H] @ [E, H, 2I] (HF layout view)
        x = torch.randn(s, h, device=dev).to(dtype)
        w = (torch.randn(e, 2 * i, h, device=dev) / h ** 0.5).to(dtype).transpose(1, 2)
        y = tk.grouped_matmul(x, w, plan.offsets, backend="triton")
        ref = grouped_matmul_reference(x[:4096].double(), w.double(),
                                       torch.clamp(plan.offsets, max=4096).to(torch.int32))
        err = (y[:4096].double() - ref).abs().max().item()
        lines += [f"## {dname}", "", f"max |triton - float64| on the first {min(s, 4096)} rows: {err:.3g}", ""]
        dy = torch.randn_like(y)
        flops = 2 * s * h * 2 * i
        impls = {"triton": (lambda a, b: tk.grouped_matmul(a, b, plan.offsets, backend="triton"), w)}
        try:
            torch._grouped_mm(x, w, offs=plan.offsets)
            impls["torch._grouped_mm"] = (lambda a, b: torch._grouped_mm(a, b, offs=plan.offsets), w)
        except Exception as ex:  # not on this device / dtype: reported, not dropped
            lines.append(f"torch._grouped_mm unavailable for {dname}: {type(ex).__name__}: {str(ex)[:120]}")
            rows.append({"dtype": dname, "impl": "torch._grouped_mm", "status": "missing",
                         "reason": f"{type(ex).__name__}: {ex}"[:300]})
        impls["dense mm"] = (lambda a, b: a @ b, torch.randn(h, 2 * i, device=dev).to(dtype))
        timed = [(impl, _time(lambda: f(x, wt), dev, args.reps, args.warmup),
                  _time(_fwd_bwd(f, x, wt, dy), dev, args.reps, args.warmup))
                 for impl, (f, wt) in impls.items()]
        dense = timed[-1][2]
        lines += ["| impl | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | vs dense (fwd+bwd) |",
                  "|---|---|---|---|---|---|"]
        for impl, tf, tb in timed:
            rows.append({"dtype": dname, "impl": impl, "status": "ok", "fwd_ms": tf * 1e3, "fwd_bwd_ms": tb * 1e3,
                         "fwd_tflops": flops / tf / 1e12, "fwd_bwd_tflops": 3 * flops / tb / 1e12,
                         "fraction_of_dense_fwd_bwd": dense / tb, "max_err_vs_float64": err if impl == "triton"
                         else None})
            lines.append(f"| {impl} | {tf * 1e3:.3f} | {flops / tf / 1e12:.1f} | {tb * 1e3:.3f} | "
                         f"{3 * flops / tb / 1e12:.1f} | {dense / tb:.2f} |")
        xs = torch.randn(t, h, device=dev).to(dtype)
        wts = torch.softmax(torch.randn(t, k, device=dev), -1)
        gu = (torch.randn(e, 2 * i, h, device=dev) / h ** 0.5).to(dtype).requires_grad_()
        dp = (torch.randn(e, h, i, device=dev) / i ** 0.5).to(dtype).requires_grad_()
        dout = torch.randn(t, h, device=dev).to(dtype)

        def moe():
            xx = xs.detach().requires_grad_()
            tk.moe_experts(xx, idx, wts, gu, dp, backend="triton").backward(dout)
        tm = _time(moe, dev, max(2, args.reps // 2), args.warmup)
        mflops = 3 * 2 * s * (h * 2 * i + i * h)
        rows.append({"dtype": dname, "impl": "moe_experts triton", "status": "ok", "fwd_bwd_ms": tm * 1e3,
                     "fwd_bwd_tflops": mflops / tm / 1e12})
        lines += ["", f"moe_experts triton fwd+bwd: {tm * 1e3:.2f} ms, {mflops / tm / 1e12:.1f} TFLOP/s", ""]
        try:
            hf = _hf_grouped_mm_experts(gu, dp, k)
            with torch.no_grad():
                diff = (hf(xs, idx, wts).float() - tk.moe_experts(xs, idx, wts, gu, dp, backend="triton").float())
                rel = (diff.abs().max() / tk.moe_experts(xs, idx, wts, gu, dp, backend="triton").float().abs().max()
                       .clamp_min(1e-12)).item()

            def moe_hf():
                xx = xs.detach().requires_grad_()
                hf(xx, idx, wts).backward(dout)
            th = _time(moe_hf, dev, max(2, args.reps // 2), args.warmup)
            rows.append({"dtype": dname, "impl": "transformers grouped_mm experts", "status": "ok",
                         "fwd_bwd_ms": th * 1e3, "fwd_bwd_tflops": mflops / th / 1e12,
                         "rel_max_diff_vs_triton": rel})
            lines += [f"transformers grouped_mm experts fwd+bwd: {th * 1e3:.2f} ms, {mflops / th / 1e12:.1f} "
                      f"TFLOP/s (triton / transformers time {tm / th:.2f}; rel max diff {rel:.2e})", ""]
        except Exception as ex:  # transformers without the experts interface, or its kernel refused the call
            rows.append({"dtype": dname, "impl": "transformers grouped_mm experts", "status": "missing",
                         "reason": f"{type(ex).__name__}: {ex}"[:300]})
            lines += [f"transformers grouped_mm experts: missing ({type(ex).__name__}: {str(ex)[:120]})", ""]
    print("\n".join(lines))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "moe_gpu.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, "moe_gpu.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
