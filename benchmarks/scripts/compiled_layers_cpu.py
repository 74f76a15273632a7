"""One MoE experts or Gated DeltaNet call under torch.compile: transformers' own code compiled vs the
twinkle custom op compiled, forward + backward, on the CPU. This is what ``twinkle_patches.apply(
under_compile=...)`` chooses between for those layers.

    python -m benchmarks.scripts.compiled_layers_cpu moe --tokens 2048 --moe 64,512,256,8
    python -m benchmarks.scripts.compiled_layers_cpu gdn --tokens 4096

Both sides are compiled with inductor and warmed up (compile time not timed), then timed with the
harness's timing loop; the figure to read is the ratio of process CPU times (steadier than wall time
on a shared machine; run with one thread, ``OMP_NUM_THREADS=1 --threads 1``, so idle threads do not
spin).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.harness import timing


def _moe(tokens: int, shape, g):
    from transformers import Qwen3MoeConfig
    from transformers.integrations.moe import grouped_mm_experts_forward
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    import twinkle_kernels as tk
    E, H, I, top = shape
    m = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E,
                                       num_experts_per_tok=top, hidden_act="silu"))
    with torch.no_grad():
        m.gate_up_proj.normal_(0, 0.05, generator=g)
        m.down_proj.normal_(0, 0.05, generator=g)
    x = torch.randn(tokens, H, generator=g).requires_grad_()
    top_w, top_i = torch.randn(tokens, E, generator=g).softmax(-1).topk(top, -1)
    label = f"moe tokens={tokens} E={E} H={H} I={I} top-{top}"
    return label, (x, m.gate_up_proj, m.down_proj), {
        "transformers grouped_mm": lambda x, gu, dp: grouped_mm_experts_forward(m, x, top_i, top_w),
        "twinkle::moe_experts": lambda x, gu, dp: tk.moe_experts(x, top_i, top_w, gu, dp),
    }


def _gdn(tokens: int, g):
    import transformers.models.qwen3_5.modeling_qwen3_5 as hf

    import twinkle_kernels as tk
    H, HV, K, V = 4, 8, 64, 64

    def r(*s):
        return torch.randn(*s, generator=g).requires_grad_()
    inputs = (r(1, tokens, H, K), r(1, tokens, H, K), r(1, tokens, HV, V), r(1, tokens, HV), r(1, tokens, HV))

    def prep(q, k, a, b):  # as the Qwen3.5 layer feeds the delta rule
        return q.repeat_interleave(HV // H, 2), k.repeat_interleave(HV // H, 2), -F.softplus(a), b.sigmoid()

    def ref(q, k, v, a, b):
        q2, k2, gl, beta = prep(q, k, a, b)
        return hf.torch_chunk_gated_delta_rule(q2, k2, v, g=gl, beta=beta, use_qk_l2norm_in_kernel=True)[0]

    def ours(q, k, v, a, b):
        q2, k2, gl, beta = prep(q, k, a, b)
        return tk.chunk_gated_delta_rule(q2, k2, v, gl, beta, use_qk_l2norm_in_kernel=True)[0]
    return f"gdn T={tokens} H={H} HV={HV} K={K} V={V}", inputs, {
        "transformers torch_chunk_gated_delta_rule": ref, "twinkle::chunk_gated_delta_rule": ours}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("layer", choices=("moe", "gdn"))
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--moe", default="16,512,256,4", help="experts,hidden,intermediate,top_k (default 16,512,256,4)")
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    if args.layer == "moe":
        label, inputs, sides = _moe(args.tokens, [int(v) for v in args.moe.split(",")], g)
    else:
        label, inputs, sides = _gdn(args.tokens, g)
    cpu = {}
    outs = {}
    for name, f in sides.items():
        compiled = torch.compile(f, backend="inductor")

        def step():
            out = compiled(*inputs)
            out.sum().backward()
            return out.detach()
        outs[name] = step()  # compiles
        step()
        t = timing.time_fn(step, torch.device("cpu"), warmup=1, min_reps=args.reps, max_reps=args.reps, budget_s=0.0)
        cpu[name] = t.cpu.median_ms
        print(f"{label}  {name:42s} wall median {t.median_ms:9.2f} ms  min {t.min_ms:9.2f}  CPU {t.cpu.median_ms:9.2f} ms",
              flush=True)
    a, b = outs.values()
    err = float((a - b).abs().max())
    (ref, ours) = cpu.values()
    print(f"{label}  transformers CPU time / twinkle CPU time = {ref / ours:.2f}  (outputs differ by {err:.1e})")


if __name__ == "__main__":
    main()
