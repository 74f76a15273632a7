"""The published-width Qwen3-0.6B at full depth (28 layers, random weights) on CPU.

    python -m benchmarks.scripts.published_widths_cpu [--steps 3] [--seq 512] [--out benchmarks/results/published_widths_cpu_<date>.md]

1. Conversion and logits: transformers builds the model (fp32) and saves it; ``MegatronModel``
   (world size 1, local layer spec) loads it, saves it back (the round trip must be bit-identical)
   and its logits on 1 x 64 tokens are compared with transformers' (max |diff|, relative to max
   |logit|, argmax agreement).
2. Step time at 1 x ``--seq`` tokens, fp32 and bf16: ``benchmarks/scripts/train_step.py`` for this
   model (transformers eager, with autocast bf16 over fp32 parameters and + twinkle_patches; the
   facade with the local spec and with twinkle kernels; each variant in its own process, its
   first-step loss checked against transformers eager fp32 before it is timed; process CPU
   seconds per step, peak RSS, phases). ``--lora`` adds the LoRA r=8 rows. Until 2026-12-05 this
   script timed its own step (the results of 2026-12-02 and 2026-12-03 came from that version:
   no autocast baseline, no loss check, no clipping in transformers' step).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import tempfile

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

# Qwen/Qwen3-0.6B's config.json (the architecture fields), at full depth; the step benchmark holds
# the written-out copy (benchmarks import nothing from tests/, and tests/ checks it)
from benchmarks.scripts.train_step import QWEN3_0_6B  # noqa: E402


def _config():
    return dict(QWEN3_0_6B)


def _check_conversion(path, root, vocab):
    """Round trip and logits of the full-depth model (fp32); returns a dict of findings."""
    import torch
    import transformers
    from safetensors.torch import load_file
    import twinkle_megatron as tm
    model = tm.MegatronModel(path, mixed_precision="fp32")
    model.save("exported", output_dir=root)
    ids = torch.randint(0, vocab, (1, 64), generator=torch.Generator().manual_seed(7))
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
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lora", action="store_true", help="also the LoRA r=8 rows")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--out", default=None)
    p.add_argument("--tiny", action="store_true", help="1 layer at tiny widths, one process: the test mode")
    a = p.parse_args(argv)
    import torch
    import transformers
    import twinkle_megatron as tm
    from twinkle_megatron.parallel.launch import free_port
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    tm.initialize(tm.DeviceMesh.from_sizes(world_size=1))
    from benchmarks.scripts import train_step
    cfg = transformers.AutoConfig.for_model(**(train_step.model_config("qwen3_0_6b", 1, tiny=True) if a.tiny
                                               else _config()))
    lines = [f"# Published-width Qwen3-0.6B, full depth, CPU ({datetime.date.today()})"
             f"{' (--tiny: the test mode, not a measurement)' if a.tiny else ''}", "",
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
        c = _check_conversion(path, root, cfg.vocab_size)
        lines += ["## Conversion and logits (fp32, TP1, 1 x 64 tokens)", "",
                  f"- HF -> megatron -> HF: {'bit-identical' if c['identical'] else 'DIFFERENT'} ({c['tensors']} tensors)",
                  f"- logits vs transformers fp32: max |diff| {c['max_diff']:.2e} ({c['rel']:.2e} of max |logit|), "
                  f"argmax agreement {c['argmax']:.4f}", ""]
    tm.shutdown()
    step = train_step.main(["--models", "qwen3_0_6b", "--layers", str(cfg.num_hidden_layers), "--seq", str(a.seq),
                            "--steps", str(a.steps), "--dtypes", "fp32,bf16"] + (["--lora"] if a.lora else [])
                           + (["--tiny", "--in-process"] if a.tiny else []))
    # its report without its title line, as this report's second section
    lines += ["## Training step (benchmarks/scripts/train_step.py)", ""] + step["text"].splitlines()[2:]
    lines += ["", f"Load average at the end: {os.getloadavg()[0]:.1f} (1 min), {os.getloadavg()[1]:.1f} (5 min). "
              f"Produced by `python -m benchmarks.scripts.published_widths_cpu --steps {a.steps} --seq {a.seq}"
              f"{' --lora' if a.lora else ''}{' --tiny' if a.tiny else ''}`."]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
