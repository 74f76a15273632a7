"""Where a training step of the tiny megatron models spends its time: twinkle specs versus
megatron-core's local spec, both built in the same process(es) (CPU), steps alternating.

    python -m benchmarks.scripts.megatron_specs_profile [--model dense|moe] [--hidden 128] [--steps 20]
                         [--profile] [--threads 1] [--tp 2 --ep 2 --sequence-parallel]

Prints the median step time per variant (the harness's ``timing.time_fn``, one step of each
variant in turn per round, the order reversed every other round) and their ratio; with
``--profile`` also a ``torch.profiler`` table (self CPU time per op) of a few steps of each
variant, so per-call overheads (Python dispatch, argument checks, copies) show up next to the
kernels. With ``--tp N`` it starts N processes (rank 0 prints). Both variants run in the same
processes, so start-up and machine-load drift cancel better than in
``benchmarks/scripts/megatron_specs.py``, which measures the end-to-end number of the training job.
"""
import argparse
import os
import sys

from benchmarks.harness import timing
from benchmarks.harness.env import ROOT, child_env
from benchmarks.scripts.megatron_specs import model_config
from twinkle_megatron.parallel.launch import free_port, run_ranks


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["dense", "moe", "hybrid"], default="dense")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--rows", type=int, default=25, help="rows of each profiler table")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (= processes started)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE; <= tp)")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--variants", default="twinkle,local",
                   help="comma list of twinkle, local, twinkle-seqexperts (twinkle specs with "
                        "megatron's SequentialMLP experts), twinkle-nosdpa (twinkle specs with "
                        "megatron's unfused attention math)")
    args = p.parse_args(argv)
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    os.environ.setdefault("PYTHONWARNINGS", "ignore")

    if "RANK" not in os.environ and args.tp > 1:  # one process per rank; rank 0 prints
        ranks = run_ranks(["-m", "benchmarks.scripts.megatron_specs_profile", *(argv if argv is not None
                                                                                else sys.argv[1:])],
                          args.tp, timeout=1800, env=child_env(), cwd=ROOT)
        print(ranks[0].output, end="")
        for r in ranks[1:]:
            if r.returncode:
                print(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-3000:]}", file=sys.stderr)
        return max(r.returncode for r in ranks)
    import torch
    torch.set_num_threads(args.threads)
    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1").items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    import twinkle_megatron as tm
    mesh = tm.DeviceMesh.from_sizes(tp_size=args.tp, ep_size=args.ep, etp_size=1 if args.model == "moe" else None,
                                    sequence_parallel=args.sequence_parallel)
    tm.initialize(mesh)
    cfg = model_config(args.model, args.hidden)
    models = {}
    from twinkle_megatron import spec
    twinkle_experts = spec.TwinkleSpecProvider.grouped_mlp_modules
    for name in args.variants.split(","):
        if name == "twinkle-seqexperts":   # the twinkle provider with the local provider's experts
            spec.TwinkleSpecProvider.grouped_mlp_modules = spec.LocalSpecProvider.grouped_mlp_modules
        try:
            m = tm.MegatronModel(cfg, device_mesh=mesh, mixed_precision="fp32", seed=0,
                                 use_twinkle_kernels=name != "local")
        finally:
            spec.TwinkleSpecProvider.grouped_mlp_modules = twinkle_experts
        if name == "twinkle-nosdpa":
            for mod in m.unwrapped_chunks()[0].modules():
                if hasattr(mod, "_twinkle_sdpa"):
                    mod._twinkle_sdpa = False
        m.set_optimizer("AdamW", lr=1e-3)
        models[name] = m
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (args.batch_size, args.seq_len), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}

    def step(m):
        m.forward_backward(inputs=batch)
        m.clip_grad_and_step(1.0)

    for m in models.values():  # warm-up
        for _ in range(3):
            step(m)
    timings, errors = timing.time_interleaved(
        {k: (lambda m=m: step(m)) for k, m in models.items()}, torch.device("cpu"),
        dict(warmup=0, min_reps=args.steps, max_reps=args.steps, budget_s=0.0), args.steps, alternate=True)
    if errors:
        raise RuntimeError("; ".join(f"{k}: {type(e).__name__}: {e}" for k, e in errors.items()))
    med = {k: t.median_ms / 1e3 for k, t in timings.items()}
    quiet = os.environ["RANK"] != "0"  # every rank profiles (collectives), rank 0 prints
    print(f"{args.model} hidden {args.hidden} TP{args.tp} EP{args.ep} SP {args.sequence_parallel} threads {args.threads}: step ms "
          + ", ".join(f"{k} {1e3 * v:.2f}" for k, v in med.items())
          + "".join(f"; local/{k} time ratio {med['local'] / v:.3f}" for k, v in med.items()
                    if k != "local" and "local" in med))
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        for k, m in models.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    step(m)
            if quiet:
                continue
            print(f"\n=== {k} (5 steps) ===")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
