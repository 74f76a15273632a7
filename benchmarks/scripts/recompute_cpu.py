"""Activation memory and step time of one training step with none / selective / full recompute.

    python -m benchmarks.scripts.recompute_cpu [--batch 4 --seq 2048] [--out FILE.md]

The model is Qwen3-4B's width cut to 4 layers (hidden 2560, 32 / 8 heads, head_dim 128,
intermediate 9728, vocab 151,936, tied embeddings), fp32, random weights, one process (gloo),
``use_twinkle_kernels`` with the fused LM-head loss (so the [tokens, vocab] logits never exist
and the layers' activations are what recompute acts on). Each setting runs in a fresh process:
one warm-up forward_backward on 16 tokens (it allocates DDP's grad buffers; with ``--optimizer``
also a step, which allocates the Adam state), then the measured forward_backward (micro-batches
of one row).

Activation memory = peak RSS during the measured forward_backward (Linux ``VmHWM``, reset
through ``/proc/self/clear_refs`` just before it) minus the RSS right before it (weights, grad
buffers, and the optimizer state if held: all resident by then), minus the same difference for a
16-token forward_backward measured the same way just before (what any step needs whatever its
length). Without ``--optimizer`` the
model holds no Adam state (8 bytes per parameter less resident; the activations are the same).
Times are the process CPU time (and wall time) of that forward_backward, one run: on a shared
machine, compare the rows of one run only. The grad norm (of the grads it left) shows the three
settings computed the same step.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import time

from benchmarks.harness.env import ROOT, child_env, cpu_model

QWEN3_4B_WIDTH = {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 2560, "intermediate_size": 9728,
                  "num_hidden_layers": 4, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                  "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                  "tie_word_embeddings": True}
SETTINGS = {
    "none": {},
    "selective": {"recompute_granularity": "selective", "recompute_modules": ["core_attn", "mlp"]},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
}


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def one(setting: str, batch: int, seq: int, optimizer: bool) -> dict:
    """Runs in a fresh process: the measured step of ``setting``."""
    import torch
    import twinkle_megatron as tm
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1")
    os.environ.setdefault("MASTER_PORT", "29611")
    tm.initialize(tm.DeviceMesh.from_sizes(world_size=1))
    model = tm.MegatronModel(QWEN3_4B_WIDTH, mixed_precision="fp32", use_twinkle_kernels=True,
                             fused_linear_ce=True, **SETTINGS[setting])
    # The embedding (tied to the LM head) stays frozen: its dense [V, H] weight grads (1.45 GiB each,
    # at any length) would otherwise set the step's peak, at a moment the activations are gone.
    for chunk in model.unwrapped_chunks():
        chunk.embedding.word_embeddings.weight.requires_grad_(False)
    if optimizer:
        model.set_optimizer("AdamW", lr=1e-5)
    g = torch.Generator().manual_seed(0)
    warm = torch.randint(0, 151936, (1, 16), generator=g)
    model.forward_backward(inputs={"input_ids": warm, "labels": warm})   # grad buffers (and Adam state)
    if optimizer:
        model.clip_grad_and_step(1.0)
    else:
        model.model[0].zero_grad_buffer()
    def measured(ids):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _status("VmRSS")
        cpu0, wall0 = time.process_time(), time.perf_counter()
        loss = model.forward_backward(inputs={"input_ids": ids, "labels": ids}, micro_batch_size=1)["loss"]
        return before, _status("VmHWM"), time.process_time() - cpu0, time.perf_counter() - wall0, loss

    # the same forward_backward on 16 tokens: what a step needs at any length
    base_before, base_peak, _, _, _ = measured(warm)
    model.model[0].zero_grad_buffer()
    ids = torch.randint(0, 151936, (batch, seq), generator=g)
    before, peak, cpu, wall, loss = measured(ids)
    grad_sq = sum(float(p.main_grad.double().pow(2).sum()) for p in model.unwrapped_chunks()[0].parameters()
                  if p.requires_grad)
    tm.shutdown()
    return {"setting": setting, "resident_before": before, "peak": peak, "step_delta": peak - before,
            "fixed": base_peak - base_before, "activation": (peak - before) - (base_peak - base_before),
            "step_cpu_s": cpu, "step_wall_s": wall, "loss": loss, "grad_norm": grad_sq ** 0.5}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--settings", default=",".join(SETTINGS))
    p.add_argument("--out", default=None, help="markdown file to write (default: print only)")
    p.add_argument("--optimizer", action="store_true",
                   help="also hold AdamW's state (+8 bytes per parameter) and run its step in the warm-up")
    p.add_argument("--retries", type=int, default=2, help="reruns of a setting killed for memory")
    p.add_argument("--mmap-threshold", type=int, default=65536,
                   help="glibc MALLOC_MMAP_THRESHOLD_ for the measured processes (0: glibc's default)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(one(args.one, args.batch, args.seq, args.optimizer)), flush=True)
        return 0
    rows = []
    for i, setting in enumerate(args.settings.split(",")):
        env = child_env({"TORCHDYNAMO_DISABLE": "1", "PYTHONWARNINGS": "ignore", "MASTER_PORT": str(29611 + i)})
        if args.mmap_threshold:
            # glibc: every block from this size up is its own mapping, returned to the OS when freed,
            # so the RSS follows the live tensors (by default freed heap memory stays resident and
            # a step's activations partly reuse it unseen)
            env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
        for attempt in range(1 + args.retries):   # a shared machine's OOM killer may take a run
            out = subprocess.run([sys.executable, "-m", "benchmarks.scripts.recompute_cpu", "--one", setting,
                                  "--batch", str(args.batch), "--seq", str(args.seq)]
                                 + (["--optimizer"] if args.optimizer else []), cwd=ROOT, env=env,
                                 capture_output=True, text=True)
            if out.returncode != -9:
                break
            print(f"{setting}: killed (out of memory), attempt {attempt + 1}", flush=True)
        line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        if out.returncode or not line:
            raise SystemExit(f"{setting} failed (exit {out.returncode}; -9: out of memory):\n"
                             f"{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
        rows.append(json.loads(line[0][7:]))
        print(rows[-1], flush=True)
    none = next((r for r in rows if r["setting"] == "none"), None)
    gib = 2 ** 30
    lines = ["| recompute | resident before (GiB) | step peak (GiB) | peak - resident (GiB) | of which fixed "
             "(16-token step, GiB) | activation (GiB) | vs none | fwd+bwd CPU s | fwd+bwd wall s | loss | grad norm |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['activation'] / none['activation']:.1%}" if none else "-"
        lines.append(f"| {r['setting']} | {r['resident_before'] / gib:.2f} | {r['peak'] / gib:.2f} | "
                     f"{r['step_delta'] / gib:.3f} | {r['fixed'] / gib:.3f} | {r['activation'] / gib:.3f} | {ratio} | "
                     f"{r['step_cpu_s']:.1f} | {r['step_wall_s']:.1f} | {r['loss']:.6f} | {r['grad_norm']:.3f} |")
    text = (f"Tokens per step: {args.batch} x {args.seq}; MALLOC_MMAP_THRESHOLD_={args.mmap_threshold or 'default'}; "
            f"optimizer state held: {args.optimizer}; CPU: {cpu_model()}; "
            f"{datetime.date.today().isoformat()}\n\n" + "\n".join(lines) + "\n")
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
