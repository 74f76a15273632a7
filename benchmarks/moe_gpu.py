"""GPU benchmark of the Triton grouped matmul and moe_experts (run on a CUDA machine).

For the MoE shape (T tokens, top-k, E experts, H, I) it checks the Triton grouped matmul
against the float64 reference, then times, with CUDA events, in one run:

- ``triton``             : ``tk.grouped_matmul(..., backend="triton")``;
- ``torch._grouped_mm``  : where this torch has it for the dtype;
- ``dense mm``           : one ``torch.mm`` of the same FLOPs ([S, K] @ [K, N]), the roofline
                           the grouped kernels are compared with;

for the forward and forward+backward, and ``moe_experts`` (triton) forward+backward.
TFLOP/s and the fraction of the dense matmul's TFLOP/s are printed.

    python benchmarks/moe_gpu.py [--tokens 4096 --hidden 2048 --inter 768 --experts 64 --topk 8]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import twinkle_kernels as tk  # noqa: E402
from twinkle_kernels.moe import grouped_matmul_reference  # noqa: E402


def _time(fn, reps=20, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


def _fwd_bwd(f, x, w, dy):
    def run():
        xx = x.detach().requires_grad_()
        ww = w.detach().requires_grad_()
        f(xx, ww).backward(dy)
    return run


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--topk", type=int, default=8)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    dev = torch.device("cuda")
    t, h, i, e, k = args.tokens, args.hidden, args.inter, args.experts, args.topk
    s = t * k
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}; T={t} H={h} I={i} E={e} top-{k} (S={s})")
    g = torch.Generator(device="cpu").manual_seed(0)
    idx = torch.topk(torch.rand(t, e, generator=g), k, dim=-1).indices.to(dev)
    plan = tk.moe.make_routing_plan(idx, e)
    for dtype in (torch.bfloat16, torch.float32):
        # the gate_up projection: [S, H] @ [E, H, 2I] (HF layout view)
        x = torch.randn(s, h, device=dev).to(dtype)
        w = (torch.randn(e, 2 * i, h, device=dev) / h ** 0.5).to(dtype).transpose(1, 2)
        y = tk.grouped_matmul(x, w, plan.offsets, backend="triton")
        ref = grouped_matmul_reference(x[:4096].double(), w.double(),
                                       torch.clamp(plan.offsets, max=4096).to(torch.int32))
        err = (y[:4096].double() - ref).abs().max().item()
        print(f"\n{dtype}: max |triton - float64| on 4096 rows = {err:.3g}")
        dy = torch.randn_like(y)
        flops = 2 * s * h * 2 * i
        impls = {"triton": (lambda a, b: tk.grouped_matmul(a, b, plan.offsets, backend="triton"), w)}
        try:
            torch._grouped_mm(x, w, offs=plan.offsets)
            impls["torch._grouped_mm"] = (lambda a, b: torch._grouped_mm(a, b, offs=plan.offsets), w)
        except Exception as ex:  # not on this device / dtype
            print(f"torch._grouped_mm unavailable for {dtype}: {type(ex).__name__}: {ex}")
        impls["dense mm"] = (lambda a, b: a @ b, torch.randn(h, 2 * i, device=dev).to(dtype))
        print("| impl | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | vs dense (fwd+bwd) |")
        print("|---|---|---|---|---|---|")
        rows = []
        for name, (f, wt) in impls.items():
            rows.append((name, _time(lambda: f(x, wt)), _time(_fwd_bwd(f, x, wt, dy))))
        dense = rows[-1][2]
        for name, tf, tb in rows:
            print(f"| {name} | {tf * 1e3:.3f} | {flops / tf / 1e12:.1f} | {tb * 1e3:.3f} | {3 * flops / tb / 1e12:.1f} "
                  f"| {dense / tb:.2f} |")
        xs = torch.randn(t, h, device=dev).to(dtype)
        wts = torch.softmax(torch.randn(t, k, device=dev), -1)
        gu = (torch.randn(e, 2 * i, h, device=dev) / h ** 0.5).to(dtype).requires_grad_()
        dp = (torch.randn(e, h, i, device=dev) / i ** 0.5).to(dtype).requires_grad_()
        dout = torch.randn(t, h, device=dev).to(dtype)

        def moe():
            xx = xs.detach().requires_grad_()
            tk.moe_experts(xx, idx, wts, gu, dp, backend="triton").backward(dout)
        tm = _time(moe, reps=10)
        mflops = 3 * 2 * s * (h * 2 * i + i * h)
        print(f"moe_experts triton fwd+bwd: {tm * 1e3:.2f} ms, {mflops / tm / 1e12:.1f} TFLOP/s")


if __name__ == "__main__":
    main()
