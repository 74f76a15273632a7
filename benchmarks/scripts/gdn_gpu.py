"""GPU benchmark of the Triton chunked gated delta rule at Qwen3.5-4B-like shapes.

Compares ``twinkle_kernels.chunk_gated_delta_rule(backend="triton")`` with fla's
``chunk_gated_delta_rule`` (when importable; reported "missing" otherwise) and with
transformers' ``torch_chunk_gated_delta_rule``, forward and forward+backward, bf16 I/O,
qk-l2norm in the op, dense batches and one packed (varlen, ``cu_seqlens``) batch; transformers'
torch path refuses ``cu_seqlens`` and is reported "unsupported" there. Before timing, each provider's output is compared with the Triton one
(relative max error), so a fast wrong kernel is visible in the same table.

Writes ``gdn_gpu.json`` and ``gdn_gpu.md`` to ``$OUT`` (or ``./out``). Without CUDA it prints
a message and exits 0. Runs in about a minute on an H200.

    python -m benchmarks.scripts.gdn_gpu [--quick]
    # smoke test (Triton interpreter, one timed call of each provider, no warm-up):
    TRITON_INTERPRET=1 python -m benchmarks.scripts.gdn_gpu --device cpu --small --dtype float32 --reps 1 --warmup 0
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch

from benchmarks.harness.env import describe
from benchmarks.harness.timing import peak_memory, time_fn

# (B, T, H key heads, HV value heads, K, V): Qwen3.5-4B's linear-attention layers use
# 16 key heads and 32 value heads of dim 128.
# A 7th entry: the sequence lengths of a packed batch (B = 1, T = their sum), run with cu_seqlens.
SHAPES = [(1, 4096, 16, 32, 128, 128), (2, 4096, 16, 32, 128, 128), (1, 8192, 16, 32, 128, 128),
          (1, 8192, 16, 32, 128, 128, (1000, 3096, 17, 2031, 2048))]
SMALL_SHAPES = [(1, 80, 2, 4, 16, 16),  # --small: a smoke test of this script (not a multiple of the chunk)
                (1, 40, 2, 4, 16, 16, (39, 1))]


def _inputs(B, T, H, HV, K, V, device, dtype, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    kw = dict(device=device, generator=gen)
    q = torch.randn(B, T, H, K, **kw).to(dtype)
    k = torch.randn(B, T, H, K, **kw).to(dtype)
    v = torch.randn(B, T, HV, V, **kw).to(dtype)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, **kw) + 3.0).to(dtype)
    beta = torch.rand(B, T, HV, **kw).sigmoid().to(dtype)
    return q, k, v, g, beta


def _provider_twinkle():
    import twinkle_kernels as tk

    def run(q, k, v, g, beta, cu=None):
        return tk.chunk_gated_delta_rule(q, k, v, g, beta, None, None, False, True, cu_seqlens=cu,
                                         backend="triton")[0]
    return run


def _provider_fla():
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

    def run(q, k, v, g, beta, cu=None):
        kw = {"use_qk_l2norm_in_kernel": True}
        if cu is not None:
            kw["cu_seqlens"] = cu.long()  # fla takes a LongTensor
        if v.shape[2] != q.shape[2]:
            try:
                return fla_chunk(q, k, v, g, beta, **kw)[0]
            except Exception:  # older fla without grouped value heads: repeat q/k per value head
                rep = v.shape[2] // q.shape[2]
                q, k = q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2)
        return fla_chunk(q, k, v, g, beta, **kw)[0]
    return run


def _provider_transformers():
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    def run(q, k, v, g, beta, cu=None):
        if cu is not None:
            raise NotImplementedError("transformers' torch_chunk_gated_delta_rule has no cu_seqlens")
        rep = v.shape[2] // q.shape[2]
        q, k = q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2)
        return torch_chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]
    return run


PROVIDERS = {"twinkle-triton": _provider_twinkle, "fla": _provider_fla, "transformers-torch": _provider_transformers}


def _time(fn, device, reps, warmup=2):
    """The harness's timing of ``fn`` over exactly ``reps`` runs (CUDA events on a GPU)."""
    return time_fn(fn, device, warmup=warmup, min_reps=reps, max_reps=reps, budget_s=0.0).as_dict()


def _bench_one(name, make, shape, device, dtype, budget_s, reps=None, warmup=2):
    """One provider at one shape. ``reps=None`` picks the repetitions from a first timed call (fewer
    for the slow baseline, within ``budget_s``); a number fixes them (the smoke test's 1)."""
    try:
        run = make()
    except Exception as e:  # not installed here
        return {"status": "missing", "reason": f"{type(e).__name__}: {e}"}
    lens = shape[6] if len(shape) > 6 else None
    cu = None if lens is None else torch.tensor([0, *lens], device=device).cumsum(0).to(torch.int32)
    xs = _inputs(*shape[:6], device=device, dtype=dtype)
    leaf = [x.detach().clone().requires_grad_(True) for x in xs]
    do = torch.randn(shape[0], shape[1], shape[3], shape[5], device=device, dtype=dtype)
    out = {"status": "ok"}
    try:
        def fwd():
            with torch.no_grad():
                return run(*xs, cu=cu)

        try:
            o = fwd()  # the first call compiles the Triton kernels
        except NotImplementedError as e:
            return {"status": "unsupported", "reason": str(e)}
        if reps is None:
            # the slow baseline gets fewer repetitions so the whole script stays short
            first = _time(fwd, device, 1, warmup=0)["median_ms"] / 1e3
            reps = 20 if first < 0.2 else max(2, min(5, int(budget_s / max(first, 1e-3) / 4)))

        def fwd_bwd():
            o = run(*leaf, cu=cu)
            torch.autograd.grad(o, leaf, do)

        out["fwd"] = _time(fwd, device, reps, warmup)
        out["fwd_bwd"] = _time(fwd_bwd, device, reps, warmup)
        # on the CPU (the smoke test) the tensor tracker would time the interpreter, not the op
        peak = peak_memory(fwd_bwd, device) if device.type == "cuda" else None
        out["peak_mem_mib"] = None if peak is None else peak / 2 ** 20
        out["output"] = o.float()
    except Exception as e:
        out = {"status": "error", "reason": f"{type(e).__name__}: {e}"[:500]}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the first shape and the packed one only")
    ap.add_argument("--device", default="cuda",
                    help="'cpu' is a smoke test of this script (Triton interpreter, use with --small)")
    ap.add_argument("--small", action="store_true", help="one tiny shape, for a smoke test")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--reps", type=int, default=None,
                    help="timed calls per provider and shape (default: 20, fewer for a slow provider)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed calls before the timed ones (default 2)")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.getcwd(), "out"))
    args = ap.parse_args(argv)
    if args.reps is not None and args.reps < 1:
        ap.error(f"--reps must be at least 1, got {args.reps}")
    if args.warmup < 0:
        ap.error(f"--warmup must be at least 0, got {args.warmup}")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gdn_gpu: no CUDA device here; nothing to benchmark (this script needs a GPU).")
        return 0
    out_dir = args.out
    os.makedirs(out_dir, exist_ok=True)
    import triton
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "dtype": str(dtype), "qk_l2norm": True}
    meta["env"] = describe(device)  # machine, versions, git commit: as in the harness's results
    try:
        import fla
        meta["fla"] = getattr(fla, "__version__", "?")
    except Exception:
        meta["fla"] = "missing"
    rows = []
    shapes = SMALL_SHAPES if args.small else [SHAPES[0], SHAPES[-1]] if args.quick else SHAPES
    for shape in shapes:
        results = {name: _bench_one(name, make, shape, device, dtype, budget_s=8.0, reps=args.reps,
                                    warmup=args.warmup)
                   for name, make in PROVIDERS.items()}
        ref = results["twinkle-triton"].get("output")
        for name, r in results.items():
            o = r.pop("output", None)
            if o is not None and ref is not None:
                r["rel_max_diff_vs_twinkle"] = ((o - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()
            row_shape = dict(zip("B T H HV K V".split(), shape))
            if len(shape) > 6:
                row_shape["varlen"] = list(shape[6])
            rows.append({"shape": row_shape, "provider": name, **r})
            print(json.dumps(rows[-1]), flush=True)
        del results
        if device.type == "cuda":
            torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "gdn_gpu.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = [f"# chunk_gated_delta_rule on {meta['device']} ({dtype}, qk-l2norm)", "",
             f"torch {meta['torch']}, triton {meta['triton']}, fla {meta['fla']}", "",
             "| B | T | H/HV | K/V | provider | fwd ms | fwd+bwd ms | peak MiB | fwd vs fla | fwd+bwd vs fla "
             "| rel diff |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s = dict(r["shape"])
        if "varlen" in s:
            s["T"] = f"{s['T']} ({len(s['varlen'])} seqs)"
        fla_row = next((x for x in rows if x["shape"] == r["shape"] and x["provider"] == "fla"
                        and x["status"] == "ok"), None)
        if r["status"] != "ok":
            lines.append(f"| {s['B']} | {s['T']} | {s['H']}/{s['HV']} | {s['K']}/{s['V']} | {r['provider']} | "
                         f"{r['status']} | | | | | {r.get('reason', '')[:60]} |")
            continue
        ratio = lambda m: (f"{r[m]['median_ms'] / fla_row[m]['median_ms']:.2f}x" if fla_row else "n/a")
        peak = "n/a" if r["peak_mem_mib"] is None else f"{r['peak_mem_mib']:.0f}"
        lines.append(f"| {s['B']} | {s['T']} | {s['H']}/{s['HV']} | {s['K']}/{s['V']} | {r['provider']} | "
                     f"{r['fwd']['median_ms']:.3f} | {r['fwd_bwd']['median_ms']:.3f} | {peak} | "
                     f"{ratio('fwd')} | {ratio('fwd_bwd')} | {r.get('rel_max_diff_vs_twinkle', 0):.2e} |")
    with open(os.path.join(out_dir, "gdn_gpu.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
