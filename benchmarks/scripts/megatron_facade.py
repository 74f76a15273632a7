"""Facade overhead: MegatronModel's training step against a hand-written megatron-core loop.

    python -m benchmarks.scripts.megatron_facade    # launches 2 ranks (TP2, CPU + gloo), writes
                                                    # benchmarks/results/megatron_facade_<date>.json

Both loops drive the same model, optimizer and scheduler objects in the same processes, so the
only difference is the facade (batch handling, loss/token reduction, metrics). Steps alternate
facade / hand-written (order reversed every other pair) to cancel drift on a shared machine,
each timed by the harness's ``timing.time_fn`` between barriers, the batch built outside the
timed region; we report the median per step with p20 / p80.
"""
import argparse
import datetime
import functools
import json
import os
import platform
import sys

from benchmarks.harness import timing
from benchmarks.harness.env import ROOT, child_env
from twinkle_megatron.parallel.launch import run_ranks

TINY = {"model_type": "qwen3", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 128, "tie_word_embeddings": False}
BATCH, SEQ, MBS, WARMUP, PAIRS = 8, 64, 2, 3, 60


def worker(pairs: int = PAIRS, warmup: int = WARMUP):
    """One rank (started by :func:`main`); rank 0 prints the run times (ms) as a JSON line."""
    import torch
    import torch.distributed as dist
    import twinkle_megatron as tm
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    mesh = tm.DeviceMesh.from_sizes(tp_size=2)
    tm.initialize(mesh)
    model = tm.MegatronModel(TINY, device_mesh=mesh, mixed_precision="fp32")
    opt = model.set_optimizer("AdamW", lr=1e-4)
    sched = model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=2, num_training_steps=1000)
    g = torch.Generator().manual_seed(0)

    def batch():
        ids = torch.randint(0, 128, (BATCH, SEQ), generator=g)
        return {"input_ids": ids, "labels": ids.clone()}

    def facade_step(b):
        model.forward_backward(inputs=b, micro_batch_size=MBS)
        model.clip_grad_and_step(1.0)

    def loss_func(mask, output):
        losses = output.float().reshape(-1)
        n = mask.sum().to(torch.int)
        loss = (losses * mask).sum()
        return loss, n, {"lm loss": torch.stack([loss.detach(), n.float()])}

    def forward_step(it, m):
        mb = next(it)
        mask = (mb["labels"] != -100).reshape(-1).float()
        return m(mb["input_ids"], mb["position_ids"], None, labels=mb["labels"].clamp(min=0)), \
            functools.partial(loss_func, mask)

    def handwritten_step(b):
        ids, labels = b["input_ids"], b["labels"]
        shifted = torch.cat([labels[:, 1:], labels.new_full((BATCH, 1), -100)], 1)
        pos = torch.arange(SEQ).expand(BATCH, -1)
        mbs = [{"input_ids": ids[i:i + MBS], "labels": shifted[i:i + MBS], "position_ids": pos[i:i + MBS]}
               for i in range(0, BATCH, MBS)]
        facade_finalize = model.config.finalize_model_grads_func
        model.config.finalize_model_grads_func = finalize_model_grads   # megatron's own, per call
        try:
            get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(mbs),
                                        model=model.model[0], num_microbatches=len(mbs), seq_length=SEQ,
                                        micro_batch_size=MBS, forward_only=False)
        finally:
            model.config.finalize_model_grads_func = facade_finalize
        opt.config.clip_grad = 1.0
        opt.step()
        sched.step(increment=1)
        for m in model.model:
            m.zero_grad_buffer()
        opt.zero_grad()

    for _ in range(warmup):
        facade_step(batch())
        handwritten_step(batch())
    current = {}

    def next_batch():  # outside the timed region; every rank starts the step together
        current["batch"] = batch()
        dist.barrier()

    def timed(step):
        def run():
            step(current["batch"])
            dist.barrier()
        return run

    timings, errors = timing.time_interleaved(
        {"facade": timed(facade_step), "handwritten": timed(handwritten_step)}, torch.device("cpu"),
        dict(warmup=0, min_reps=pairs, max_reps=pairs, budget_s=0.0), pairs, before=next_batch, alternate=True)
    if errors:
        raise RuntimeError("; ".join(f"{k}: {type(e).__name__}: {e}" for k, e in errors.items()))
    if dist.get_rank() == 0:
        print(json.dumps({k: t.times for k, t in timings.items()}))  # ms
    tm.shutdown()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="JSON file to write (default benchmarks/results/"
                   "megatron_facade_<date>.json)")
    p.add_argument("--pairs", type=int, default=PAIRS, help=f"timed steps of each loop (default {PAIRS})")
    p.add_argument("--warmup", type=int, default=WARMUP, help=f"untimed steps of each loop first (default {WARMUP})")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.pairs, args.warmup)
        return 0
    import megatron.core
    import torch
    ranks = run_ranks(["-m", "benchmarks.scripts.megatron_facade", "--worker", "--pairs", str(args.pairs),
                       "--warmup", str(args.warmup)], 2, timeout=900, cwd=ROOT,
                      env=child_env({"TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1"}))
    lines = [line for line in ranks[0].output.splitlines() if line.startswith("{")]
    if any(r.returncode for r in ranks) or not lines:
        sys.exit("benchmark failed:\n" + "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n"
                                                     f"{r.output[-3000:]}" for r in ranks))
    times = json.loads(lines[-1])
    stats = {k: timing.summarize(v) for k, v in times.items()}
    med = {k: t.median_ms / 1e3 for k, t in stats.items()}
    report = {
        "benchmark": "facade step vs hand-written megatron-core step",
        "command": "python -m benchmarks.scripts.megatron_facade " + " ".join(argv if argv is not None
                                                                             else sys.argv[1:]),
        "layout": "TP2, CPU + gloo, fp32", "model": TINY, "batch": BATCH, "seq": SEQ,
        "micro_batch": MBS, "steps_each": args.pairs,
        "median_s": med,
        "p20_s": {k: t.p20_ms / 1e3 for k, t in stats.items()},
        "p80_s": {k: t.p80_ms / 1e3 for k, t in stats.items()},
        "facade_over_handwritten": med["facade"] / med["handwritten"],
        # the fastest steps are the least disturbed by other work on a shared machine
        "facade_over_handwritten_min": stats["facade"].min_ms / stats["handwritten"].min_ms,
        "facade_over_handwritten_p20": stats["facade"].p20_ms / stats["handwritten"].p20_ms,
        "versions": {"torch": torch.__version__, "megatron-core": megatron.core.__version__,
                     "python": platform.python_version()},
        "machine": platform.processor() or platform.machine(),
    }
    out = args.out or os.path.join(ROOT, "benchmarks", "results",
                                   f"megatron_facade_{datetime.date.today().isoformat()}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
