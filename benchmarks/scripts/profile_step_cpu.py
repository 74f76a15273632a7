"""Where one training step's time goes, on CPU: transformers against the facade (issue 48).

    python -m benchmarks.scripts.profile_step_cpu [--layers 8] [--seq 512] [--out benchmarks/results/<file>.md]

Qwen3-0.6B's published width (hidden 1024, 16/8 heads of 128, MLP 3072, vocab 151936, tied) at
``--layers`` depth, random weights, 1 x ``--seq`` tokens, one process. Variants, each after one
warm-up step:

- transformers bf16 parameters (pure bf16 AdamW), and transformers fp32 parameters under
  ``torch.autocast(bfloat16)`` (what HF Trainer's ``bf16=True`` runs);
- the facade in bf16 (fp32 main parameters and grads), local spec and ``use_twinkle_kernels``.

Per variant: process CPU seconds of the phases (transformers: forward, backward, optimizer; the
facade: ``forward_backward`` = forward + backward + main-grad accumulation, ``clip_grad_and_step`` =
grad finalisation, norm, optimizer, zeroing) and the top ops by self CPU time from
``torch.profiler`` over one step. Timed phases run without the profiler; the profile is a separate
step. Process CPU time, because this machine is shared; ratios come from this one run.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import tempfile
import time

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

WIDTH = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=1024,
             intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
             hidden_act="silu", max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
             attention_bias=False, tie_word_embeddings=True)


def _cpu(fn):
    c = time.process_time()
    out = fn()
    return time.process_time() - c, out


def _top_ops(step, n=12):
    import torch
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in rows) or 1
    return [(e.key, e.count, e.self_cpu_time_total / 1e6, e.self_cpu_time_total / total) for e in rows[:n]]


def _hf(path, batch, autocast, steps):
    import torch
    import transformers
    dtype = torch.float32 if autocast else torch.bfloat16
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    phases = {"forward": [], "backward": [], "optimizer": []}

    def step(record=False):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            t_f, loss = _cpu(lambda: model(**batch).loss)
        t_b, _ = _cpu(loss.backward)
        t_o, _ = _cpu(lambda: (opt.step(), opt.zero_grad(set_to_none=True)))
        if record:
            for k, v in zip(phases, (t_f, t_b, t_o)):
                phases[k].append(v)
    step()
    for _ in range(steps):
        step(record=True)
    ops = _top_ops(step)
    del model, opt
    gc.collect()
    return {k: sorted(v)[len(v) // 2] for k, v in phases.items()}, ops


def _facade(path, batch, kernels, steps):
    import twinkle_megatron as tm
    model = tm.MegatronModel(path, mixed_precision="bf16", use_twinkle_kernels=kernels)
    model.set_optimizer("AdamW", lr=1e-5)
    phases = {"forward_backward": [], "clip_grad_and_step": []}

    def step(record=False):
        t_fb, _ = _cpu(lambda: model.forward_backward(inputs=batch))
        t_s, _ = _cpu(lambda: model.clip_grad_and_step(1.0))
        if record:
            phases["forward_backward"].append(t_fb)
            phases["clip_grad_and_step"].append(t_s)
    step()
    for _ in range(steps):
        step(record=True)
    ops = _top_ops(step)
    del model
    gc.collect()
    return {k: sorted(v)[len(v) // 2] for k, v in phases.items()}, ops


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    import torch
    import transformers
    import twinkle_megatron as tm
    from twinkle_megatron.parallel.launch import free_port
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    tm.initialize(tm.DeviceMesh.from_sizes(world_size=1))
    cfg = transformers.AutoConfig.for_model(**dict(WIDTH, num_hidden_layers=a.layers))
    lines = [f"# One training step's profile, Qwen3-0.6B width, {a.layers} layers, 1 x {a.seq} tokens, CPU "
             f"({datetime.date.today()})", "",
             f"- machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
             f"{torch.__version__}, transformers {transformers.__version__}; load average at the start "
             f"{os.getloadavg()[0]:.1f}; process CPU seconds (all threads), median of {a.steps} steps after a "
             "warm-up; the op tables are one further step under torch.profiler", ""]
    with tempfile.TemporaryDirectory() as root:
        torch.manual_seed(0)
        hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        path = os.path.join(root, "model")
        hf.save_pretrained(path)
        del hf
        gc.collect()
        ids = torch.randint(0, cfg.vocab_size, (1, a.seq), generator=torch.Generator().manual_seed(0))
        batch = {"input_ids": ids, "labels": ids}
        runs = [("transformers, bf16 parameters", lambda: _hf(path, batch, False, a.steps)),
                ("transformers, fp32 parameters + autocast bf16", lambda: _hf(path, batch, True, a.steps)),
                ("MegatronModel bf16, local spec", lambda: _facade(path, batch, False, a.steps)),
                ("MegatronModel bf16, use_twinkle_kernels", lambda: _facade(path, batch, True, a.steps))]
        results = []
        for name, run in runs:
            phases, ops = run()
            results.append((name, phases, ops))
            print(name, {k: round(v, 3) for k, v in phases.items()}, flush=True)
        base = sum(results[1][1].values())
        lines += ["## Phases (CPU s per step)", "", "| variant | phases | total | vs transformers + autocast |",
                  "|---|---|---|---|"]
        for name, phases, _ in results:
            total = sum(phases.values())
            parts = ", ".join(f"{k} {v:.2f}" for k, v in phases.items())
            lines.append(f"| {name} | {parts} | {total:.2f} | {base / total:.2f}x |")
        for name, _, ops in results:
            lines += ["", f"## {name}: top ops by self CPU time (one step)", "",
                      "| op | calls | self CPU s | share |", "|---|---|---|---|"]
            lines += [f"| `{k}` | {c} | {t:.3f} | {s:.1%} |" for k, c, t, s in ops]
    lines += ["", f"- load average at the end {os.getloadavg()[0]:.1f}"]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    tm.shutdown()


if __name__ == "__main__":
    main()
