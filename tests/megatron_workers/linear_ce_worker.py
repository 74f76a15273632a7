"""One rank of the vocab-parallel fused linear cross-entropy check (gloo, CPU).

Every rank builds the same inputs, runs the single-process op on the full weight and the
vocab-parallel op on its shard (plain, and with sequence parallelism: the hidden states split
along dim 0), and writes the largest differences of outputs and gradients to result<rank>.json.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

import twinkle_kernels as tk
from twinkle_kernels.linear_ce.vocab_parallel import vocab_parallel_fused_linear_cross_entropy


def _grads(outs, coefs, *params):
    total = sum((o.double() * c).sum() for o, c in zip(outs, coefs))
    return torch.autograd.grad(total, params)


def main():
    spec = json.load(open(sys.argv[1]))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    S, B, H, V = 6, 2, 16, 50  # tokens [S, B] as Megatron's [s, b, h]; V split in 2 x 25 (not a multiple of 8)
    h = torch.randn(S, B, H)
    w = torch.randn(V, H) / 2
    bias = torch.randn(V) * 0.3
    y = torch.randint(0, V, (S, B))
    y[0, 0] = y[3, 1] = -100
    Vs = V // world
    results = {}
    for name, kw in spec["cases"].items():
        n_out = 1 + bool(kw.get("return_logps")) + bool(kw.get("return_entropy"))
        shape = () if kw.get("reduction", "mean") != "none" else y.shape
        g = torch.Generator().manual_seed(1)
        coefs = [torch.randn(shape if i == 0 else y.shape, generator=g, dtype=torch.float64) for i in range(n_out)]
        hf, wf, bf = (t.clone().requires_grad_(True) for t in (h, w, bias))
        ref = tk.fused_linear_cross_entropy(hf, wf, y, bias=bf, backend="reference", **kw)
        ref = ref if isinstance(ref, tuple) else (ref,)
        gh_ref, gw_ref, gb_ref = _grads(ref, coefs, hf, wf, bf)
        for sp in (False, True):
            hs = (h.chunk(world, 0)[rank] if sp else h).clone().requires_grad_(True)
            ws = w[rank * Vs:(rank + 1) * Vs].clone().requires_grad_(True)
            bs = bias[rank * Vs:(rank + 1) * Vs].clone().requires_grad_(True)
            out = vocab_parallel_fused_linear_cross_entropy(hs, ws, y, None, bias=bs, sequence_parallel=sp,
                                                            chunk_size=5, **kw)
            out = out if isinstance(out, tuple) else (out,)
            gh, gw, gb = _grads(out, coefs, hs, ws, bs)
            exp_h = gh_ref.chunk(world, 0)[rank] if sp else gh_ref
            errs = {f"out{i}": (o.double() - r.double()).abs().max().item() for i, (o, r) in enumerate(zip(out, ref))}
            errs["d_hidden"] = (gh.double() - exp_h.double()).abs().max().item()
            errs["d_weight"] = (gw.double() - gw_ref[rank * Vs:(rank + 1) * Vs].double()).abs().max().item()
            errs["d_bias"] = (gb.double() - gb_ref[rank * Vs:(rank + 1) * Vs].double()).abs().max().item()
            results[f"{name}{'_sp' if sp else ''}"] = errs
    with open(os.path.join(os.environ["TWINKLE_TEST_OUT"], f"result{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
