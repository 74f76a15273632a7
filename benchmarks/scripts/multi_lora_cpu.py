"""Multi-tenant LoRA on one MegatronModel, CPU, one process (gloo): mixed vs time-shared steps,
memory of 8 adapters vs one, and what ``remove_adapter`` frees.

    OMP_NUM_THREADS=1 python -m benchmarks.scripts.multi_lora_cpu [--rounds 5] [--big]

- Step: 8 adapters (LoRA r=8 all-linear) x 1 sample of 128 tokens each. Mixed: one
  ``forward_backward(adapter_names=[8 names])`` + ``clip_grad_and_step()``; time-shared: 8
  ``forward_backward(adapter_name=...)`` calls of one row + ``clip_grad_and_step()``. Tokens per
  process-CPU-second, median of interleaved rounds (process CPU time: the machine is shared).
- Memory: live tensor bytes (parameters, grad buffers, optimizer state: every tensor storage
  reachable, counted once) plus the peak of the tensors a training step creates above them
  (``benchmarks.harness.timing.LiveTensorTracker``), for 8 adapters (mixed step) and for one adapter
  (the same 8 rows); ``--big`` adds a larger Qwen3 where the base dominates, as in real models.
- ``remove_adapter``: live bytes before and after, against the adapter's own parameter, grad
  buffer and Adam state bytes computed from its parameter count.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

import torch

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

LORA = {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"}
SEQ, ADAPTERS = 128, 8


def live_bytes() -> int:
    """Bytes of every tensor storage reachable from Python (each storage once)."""
    gc.collect()
    seen = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
                st = obj.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
        except Exception:   # objects that are not fully built tensors
            continue
    seen.pop(0, None)
    return sum(seen.values())


def build(tm, config, names):
    model = tm.MegatronModel(config, device_mesh=tm.DeviceMesh.from_sizes(world_size=1), mixed_precision="fp32")
    for n in names:
        model.add_adapter_to_model(n, LORA)
        model.set_optimizer("AdamW", lr=1e-4, adapter_name=n)
    return model


def rows(vocab: int, n: int = ADAPTERS):
    ids = torch.randint(0, vocab, (n, SEQ), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def mixed_step(model, names, batch):
    model.forward_backward(inputs=batch, adapter_names=names)
    model.clip_grad_and_step(1.0)


def shared_step(model, names, batch):
    for i, n in enumerate(names):
        model.forward_backward(inputs={k: v[i:i + 1] for k, v in batch.items()}, adapter_name=n)
    model.clip_grad_and_step(1.0)


def cpu_seconds(fn) -> float:
    t = time.process_time()
    fn()
    return time.process_time() - t


def throughput(tm, config, rounds: int):
    names = [f"t{i}" for i in range(ADAPTERS)]
    model = build(tm, config, names)
    batch = rows(config["vocab_size"])
    for _ in range(2):    # warm-up (first calls build DDP wraps, load the kernels)
        mixed_step(model, names, batch)
        shared_step(model, names, batch)
    times = {"mixed": [], "time-shared": [], "mixed fb": [], "time-shared fb": []}
    for _ in range(rounds):
        times["mixed"].append(cpu_seconds(lambda: mixed_step(model, names, batch)))
        times["time-shared"].append(cpu_seconds(lambda: shared_step(model, names, batch)))
        # the forward_backward calls alone (the 8 optimizer steps are the same work either way)
        times["mixed fb"].append(cpu_seconds(lambda: model.forward_backward(inputs=batch, adapter_names=names)))
        model.clip_grad_and_step(1.0)
        times["time-shared fb"].append(cpu_seconds(
            lambda: [model.forward_backward(inputs={k: v[i:i + 1] for k, v in batch.items()}, adapter_name=n)
                     for i, n in enumerate(names)]))
        model.clip_grad_and_step(1.0)
    return {k: statistics.median(v) for k, v in times.items()}, times


def memory(tm, config, n_adapters: int):
    """(resident bytes after two steps, peak bytes of a third step above them)."""
    from benchmarks.harness.timing import LiveTensorTracker
    names = [f"t{i}" for i in range(n_adapters)]
    model = build(tm, config, names)
    batch = rows(config["vocab_size"])
    def one():
        model.forward_backward(inputs=batch, adapter_name=names[0])
        model.clip_grad_and_step(1.0)
    step = (lambda: mixed_step(model, names, batch)) if n_adapters > 1 else one
    for _ in range(2):
        step()
    resident = live_bytes()
    with LiveTensorTracker() as tracker:
        step()
    out = resident, tracker.peak
    del model
    gc.collect()
    return out


def removal(tm, config):
    names = [f"t{i}" for i in range(ADAPTERS)]
    model = build(tm, config, names)
    batch = rows(config["vocab_size"])
    mixed_step(model, names, batch)
    params = sum(p.numel() for m in model.adapters["t0"].modules for p in m.parameters())
    before = live_bytes()
    model.remove_adapter("t0")
    after = live_bytes()
    # fp32: the parameter, its slot in the adapter's DDP grad buffer, Adam's two moments
    return before, after, params * 4 * 4, params


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--big", action="store_true", help="also measure memory on a larger Qwen3 (h=1024, 8 layers)")
    args = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from twinkle_megatron.parallel.launch import free_port
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    import twinkle_megatron as tm
    from twinkle_megatron.job.configs import tiny_qwen3_config
    tm.initialize(tm.DeviceMesh.from_sizes(world_size=1))
    quick = tiny_qwen3_config(num_layers=2)
    medians, times = throughput(tm, quick, args.rounds)
    tokens = ADAPTERS * SEQ
    print(f"step, {ADAPTERS} adapters x 1 x {SEQ} tokens, tiny Qwen3 h=128 2 layers, LoRA r=8 all-linear, "
          f"{args.rounds} interleaved rounds, process CPU s per step:")
    for k, v in times.items():
        print(f"  {k:15s} median {medians[k] * 1e3:8.1f} ms  ({', '.join(f'{x * 1e3:.0f}' for x in v)})  "
              f"{tokens / medians[k]:8.0f} tokens/CPU-s")
    print(f"  mixed / time-shared tokens per CPU-second: step {medians['time-shared'] / medians['mixed']:.2f}x, "
          f"forward_backward alone {medians['time-shared fb'] / medians['mixed fb']:.2f}x")
    configs = [("tiny Qwen3 h=128 2 layers", quick)]
    if args.big:
        big = dict(tiny_qwen3_config(num_layers=8), hidden_size=1024, intermediate_size=2816,
                   num_attention_heads=16, num_key_value_heads=8, head_dim=64, vocab_size=32768)
        configs.append(("Qwen3 h=1024 8 layers vocab 32768", big))
    for label, cfg in configs:
        one = memory(tm, cfg, 1)
        eight = memory(tm, cfg, ADAPTERS)
        print(f"memory, {label}, 8 rows x {SEQ} tokens per step: resident + step peak bytes")
        print(f"  1 adapter : {one[0]:>12,d} + {one[1]:>12,d} = {sum(one):>12,d}")
        print(f"  8 adapters: {eight[0]:>12,d} + {eight[1]:>12,d} = {sum(eight):>12,d}   "
              f"ratio {sum(eight) / sum(one):.3f}x")
    before, after, expected, params = removal(tm, quick)
    print(f"remove_adapter (tiny Qwen3, 8 adapters after a step): live bytes {before:,d} -> {after:,d}, "
          f"freed {before - after:,d}; the adapter's params+grad buffer+Adam m,v = {params:,d} x 16 = {expected:,d}")
    tm.shutdown()


if __name__ == "__main__":
    main()
