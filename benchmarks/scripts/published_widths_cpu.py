"""The published-width Qwen3-0.6B at full depth (28 layers, random weights) on CPU, one process.

    python -m benchmarks.scripts.published_widths_cpu [--steps 2] [--out benchmarks/results/published_widths_cpu_<date>.md]

1. Conversion and logits: transformers builds the model (fp32) and saves it; ``MegatronModel``
   (world size 1, local layer spec) loads it, saves it back (the round trip must be bit-identical)
   and its logits on 1 x 64 tokens are compared with transformers' (max |diff|, relative to max
   |logit|, argmax agreement).
2. Step time at 1 x 512 tokens, fp32 and bf16: one training step (forward, backward, AdamW) of
   transformers eager, transformers patched with ``twinkle_patches.apply`` (the same model object,
   reverted afterwards), and the facade (``MegatronModel``, local spec, then ``use_twinkle_kernels``).
   One warm-up step, then ``--steps`` timed steps each; we report process CPU seconds per step
   (this machine is shared, so CPU time, not wall time, and ratios from this one run). The models
   run one after another and are freed in between (one 0.6B model with AdamW state is ~10 GB).
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



# Qwen/Qwen3-0.6B's config.json (the architecture fields), at full depth. The tests' published
# table holds the same entry; benchmarks import nothing from tests/, so it is written out here.
QWEN3_0_6B = dict(
    model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=1024,
    intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
    head_dim=128, hidden_act="silu", max_position_embeddings=40960, rms_norm_eps=1e-6,
    rope_theta=1000000.0, rope_scaling=None, attention_bias=False, tie_word_embeddings=True,
    use_sliding_window=False, sliding_window=None, max_window_layers=28)


def _config():
    return dict(QWEN3_0_6B)


def _timed(step, steps):
    step()   # warm-up (allocates the optimizer state)
    cpu, wall = [], []
    for _ in range(steps):
        c0, w0 = time.process_time(), time.perf_counter()
        step()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return sorted(cpu)[len(cpu) // 2], sorted(wall)[len(wall) // 2]


def _hf_rows(path, dtype, batch, steps):
    import torch
    import transformers
    import twinkle_patches as tp
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step():
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    rows = [("transformers eager",) + _timed(step, steps)]
    report = tp.apply(model)
    try:
        rows.append((f"transformers + twinkle_patches ({len(report.swapped)} swaps)",) + _timed(step, steps))
    finally:
        tp.revert(report)
    del model, opt
    gc.collect()
    return rows


def _facade_rows(path, precision, batch, steps):
    import twinkle_megatron as tm
    rows = []
    for kernels in (False, True):
        model = tm.MegatronModel(path, mixed_precision=precision, use_twinkle_kernels=kernels)
        model.set_optimizer("AdamW", lr=1e-5)

        def step():
            out = model.forward_backward(inputs=batch)
            model.clip_grad_and_step(1.0)
            return out["loss"]
        rows.append((f"MegatronModel ({'use_twinkle_kernels' if kernels else 'local spec'})",) + _timed(step, steps))
        del model
        gc.collect()
    return rows


def _check_conversion(path, root):
    """Round trip and logits of the full-depth model (fp32); returns a dict of findings."""
    import torch
    import transformers
    from safetensors.torch import load_file
    import twinkle_megatron as tm
    model = tm.MegatronModel(path, mixed_precision="fp32")
    model.save("exported", output_dir=root)
    ids = torch.randint(0, 151936, (1, 64), generator=torch.Generator().manual_seed(7))
    mine = model.logits(ids)
    del model
    gc.collect()

    def weights(p):
        out = {}
        for f in sorted(os.listdir(p)):
            if f.endswith(".safetensors"):
                out.update(load_file(os.path.join(p, f)))
        return out
    a, b = weights(path), weights(os.path.join(root, "exported"))
    identical = set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    n_tensors = len(a)
    del a, b
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    del hf
    gc.collect()
    diff = float((mine - ref).abs().max())
    return dict(identical=identical, tensors=n_tensors, max_diff=diff, rel=diff / float(ref.abs().max()),
                argmax=float((mine.argmax(-1) == ref.argmax(-1)).float().mean()))


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    import torch
    import transformers
    import twinkle_megatron as tm
    from twinkle_megatron.parallel.launch import free_port
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    tm.initialize(tm.DeviceMesh.from_sizes(world_size=1))
    cfg = transformers.AutoConfig.for_model(**_config())
    lines = [f"# Published-width Qwen3-0.6B, full depth, CPU ({datetime.date.today()})", "",
             f"- machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
             f"{torch.__version__}, transformers {transformers.__version__}; load average at the start "
             f"{os.getloadavg()[0]:.1f} (at the end: below); times are process CPU seconds (all threads) "
             "per step, ratios from this one run", f"- model: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
             f"{cfg.num_attention_heads}/{cfg.num_key_value_heads} heads of {cfg.head_dim}, vocab {cfg.vocab_size}, "
             "tied embeddings, random weights", ""]
    with tempfile.TemporaryDirectory() as root:
        torch.manual_seed(0)
        hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        path = os.path.join(root, "qwen3_0_6b")
        hf.save_pretrained(path)
        del hf
        gc.collect()
        c = _check_conversion(path, root)
        lines += ["## Conversion and logits (fp32, TP1, 1 x 64 tokens)", "",
                  f"- HF -> megatron -> HF: {'bit-identical' if c['identical'] else 'DIFFERENT'} ({c['tensors']} tensors)",
                  f"- logits vs transformers fp32: max |diff| {c['max_diff']:.2e} ({c['rel']:.2e} of max |logit|), "
                  f"argmax agreement {c['argmax']:.4f}", ""]
        ids = torch.randint(0, cfg.vocab_size, (1, a.seq), generator=torch.Generator().manual_seed(0))
        batch = {"input_ids": ids, "labels": ids}
        lines += [f"## Training step, 1 x {a.seq} tokens (median of {a.steps} after one warm-up)", "",
                  "| precision | variant | CPU s / step | wall s / step | CPU vs transformers eager |",
                  "|---|---|---|---|---|"]
        for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            rows = _hf_rows(path, dtype, batch, a.steps) + _facade_rows(path, precision, batch, a.steps)
            base = rows[0][1]
            for name, cpu, wall in rows:
                lines.append(f"| {precision} | {name} | {cpu:.2f} | {wall:.2f} | {base / cpu:.2f}x |")
                print(lines[-1], flush=True)
        lines += ["", "transformers runs bf16 as bf16 parameters and AdamW on them; the facade's bf16 keeps fp32 "
                  "main parameters and gradients (megatron's mixed precision), so its step does more work.",
                  "", f"Load average at the end: {os.getloadavg()[0]:.1f} (1 min), {os.getloadavg()[1]:.1f} (5 min). "
                  f"Produced by `python -m benchmarks.scripts.published_widths_cpu --steps {a.steps} --seq {a.seq}`."]
    tm.shutdown()
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
