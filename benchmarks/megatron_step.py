"""Facade overhead: MegatronModel's training step against a hand-written megatron-core loop.

    python benchmarks/megatron_step.py            # launches 2 ranks (TP2, CPU + gloo), writes
                                                  # benchmarks/results/megatron_step.json

Both loops drive the same model, optimizer and scheduler objects in the same processes, so the
only difference is the facade (batch handling, loss/token reduction, metrics). Steps alternate
facade / hand-written to cancel drift on a shared machine; we report the median per step.
"""
import functools
import json
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TINY = {"model_type": "qwen3", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 128, "tie_word_embeddings": False}
BATCH, SEQ, MBS, WARMUP, PAIRS = 8, 64, 2, 3, 60


def worker(spec_path):
    import torch
    import torch.distributed as dist
    import twinkle_megatron as tm
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    spec = json.load(open(spec_path))
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

    for _ in range(WARMUP):
        facade_step(batch())
        handwritten_step(batch())
    times = {"facade": [], "handwritten": []}
    for i in range(PAIRS):
        order = [("facade", facade_step), ("handwritten", handwritten_step)]
        for name, fn in (order if i % 2 == 0 else order[::-1]):
            b = batch()
            dist.barrier()
            t0 = time.perf_counter()
            fn(b)
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
    if dist.get_rank() == 0:
        with open(os.path.join(os.environ["TWINKLE_TEST_OUT"], "result0.json"), "w") as f:
            json.dump(times, f)
    tm.shutdown()


def main():
    from tests.megatron_workers.launch import launch
    import torch
    import megatron.core
    out = os.path.join(ROOT, "benchmarks", "results")
    work = os.path.join("/tmp", f"twinkle-megatron-bench-{os.getpid()}")
    results, rcs, logs, elapsed = launch(2, {}, work, timeout=900, script=os.path.abspath(__file__))
    if rcs != [0, 0] or results[0] is None:
        sys.exit("benchmark failed:\n" + logs[0][-4000:])
    times = results[0]
    med = {k: statistics.median(v) for k, v in times.items()}
    report = {
        "benchmark": "facade step vs hand-written megatron-core step",
        "layout": "TP2, CPU + gloo, fp32", "model": TINY, "batch": BATCH, "seq": SEQ,
        "micro_batch": MBS, "steps_each": PAIRS,
        "median_s": med,
        "p20_s": {k: statistics.quantiles(v, n=5)[0] for k, v in times.items()},
        "p80_s": {k: statistics.quantiles(v, n=5)[3] for k, v in times.items()},
        "facade_over_handwritten": med["facade"] / med["handwritten"],
        # the fastest steps are the least disturbed by other work on a shared machine
        "facade_over_handwritten_min": min(times["facade"]) / min(times["handwritten"]),
        "facade_over_handwritten_p20": (statistics.quantiles(times["facade"], n=5)[0]
                                        / statistics.quantiles(times["handwritten"], n=5)[0]),
        "versions": {"torch": torch.__version__, "megatron-core": megatron.core.__version__,
                     "python": platform.python_version()},
        "machine": platform.processor() or platform.machine(),
    }
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "megatron_step.json"), "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    if len(sys.argv) > 1:
        worker(sys.argv[1])
    else:
        main()
