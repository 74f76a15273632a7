"""End-to-end training-step time of tiny megatron-core models on CPU (TP2, 2 processes):
twinkle_megatron.spec's twinkle provider (fused ops) versus megatron-core's local spec, measured in one run.

    python -m benchmarks.scripts.megatron_specs [--steps 30] [--rounds 3] [--models dense,moe,hybrid]
                                                [--hidden 128] [--seq-len 64]

Each round runs the training job (``python -m twinkle_megatron.job``) once per variant, in
alternating order, on the same data and weights, and reads the steady-state tokens/s it reports
(the first log interval, which includes warm-up, is dropped). Prints a Markdown table: median
tokens/s per variant, the ratio of the medians and the median of the per-round ratios (each
round's two jobs ran back to back, so that ratio is less exposed to load drift on a shared
machine), plus the load average before and after.

``--hidden`` scales the models: hidden size and (expert) intermediate sizes grow by
``hidden / 128``; heads, head dim, layers and experts stay as in the tiny configs.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

from benchmarks.harness.env import ROOT, child_env

MOE_CONFIG = {
    "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 320,
    "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 1024, "rms_norm_eps": 1e-6,
    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 96, "norm_topk_prob": True,
    "tie_word_embeddings": False, "bos_token_id": 257, "eos_token_id": 258, "pad_token_id": 256,
}


def model_config(model: str, hidden: int = 128) -> dict:
    """The HF config of ``model`` ("dense": the training job's embedded tiny Qwen3; "hybrid": its
    embedded tiny Qwen3.5 hybrid, Gated DeltaNet + gated attention; "moe": :data:`MOE_CONFIG`)
    with hidden and intermediate sizes scaled by ``hidden / 128``."""
    if model in ("dense", "hybrid"):
        from twinkle_megatron.job.configs import tiny_qwen3_5_config, tiny_qwen3_config
        cfg = tiny_qwen3_config() if model == "dense" else tiny_qwen3_5_config()
    elif model == "moe":
        cfg = dict(MOE_CONFIG)
    else:
        raise ValueError(f"unknown model {model!r}")
    if hidden != cfg["hidden_size"]:
        scale = hidden / cfg["hidden_size"]
        cfg["hidden_size"] = hidden
        for key in ("intermediate_size", "moe_intermediate_size"):
            if key in cfg:
                cfg[key] = int(round(cfg[key] * scale / 16)) * 16
    return cfg


def run_job(model: str, twinkle: bool, steps: int, workdir: str, hidden: int = 128,
            seq_len: int = 64) -> float:
    args = [sys.executable, "-m", "twinkle_megatron.job", "--steps", str(steps), "--log-every", "5",
            "--no-sample", "--output-dir", os.path.join(workdir, "out"), "--warmup", "2",
            "--seq-len", str(seq_len)]
    if model == "hybrid" and hidden == 128:
        args.append("--hybrid")
    elif model == "moe" or hidden != 128:
        cfg_dir = os.path.join(workdir, f"{model}{hidden}")
        os.makedirs(cfg_dir, exist_ok=True)
        with open(os.path.join(cfg_dir, "config.json"), "w") as f:
            json.dump(model_config(model, hidden), f)
        args += ["--model-dir", cfg_dir]
    if model == "moe":
        # MoE with TP needs sequence parallelism; experts split over the two ranks (EP2, expert
        # TP 1: the grouped path serves expert-TP 1 only).
        args += ["--sequence-parallel", "--ep", "2", "--etp", "1"]
    if not twinkle:
        args.append("--no-twinkle-kernels")
    env = child_env()
    env.pop("RANK", None)
    out = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if out.returncode:
        raise RuntimeError(f"{model} twinkle={twinkle} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    rates = [float(x) for x in re.findall(r"tokens/s (\d+)", out.stdout)]
    if len(rates) < 3:
        raise RuntimeError(f"too few log lines:\n{out.stdout[-2000:]}")
    return statistics.median(rates[2:])   # drop step 1 and the first interval (warm-up)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--models", default="dense,moe")
    p.add_argument("--hidden", type=int, default=128, help="hidden size (default 128, the tiny configs)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per row (batch: 16 rows)")
    args = p.parse_args(argv)
    rows = []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            res = {True: [], False: []}
            for r in range(args.rounds):
                order = (True, False) if r % 2 == 0 else (False, True)
                for tw in order:
                    res[tw].append(run_job(model, tw, args.steps, tmp, args.hidden, args.seq_len))
                    print(f"{model} round {r} twinkle={tw}: {res[tw][-1]:.0f} tokens/s "
                          f"(load {os.getloadavg()[0]:.1f})", flush=True)
            tw, loc = statistics.median(res[True]), statistics.median(res[False])
            paired = statistics.median(a / b for a, b in zip(res[True], res[False]))
            rows.append((model, tw, loc, tw / loc, paired, res))
    load_after = os.getloadavg()
    print(f"\n| model (TP2, CPU, hidden {args.hidden}, seq {args.seq_len}) | twinkle specs tokens/s | local spec tokens/s "
          f"| ratio of medians | median per-round ratio |")
    print("|---|---|---|---|---|")
    for model, tw, loc, ratio, paired, res in rows:
        print(f"| {model} | {tw:.0f} | {loc:.0f} | {ratio:.3f} | {paired:.3f} |")
    for model, tw, loc, ratio, paired, res in rows:
        print(f"raw {model}: twinkle {[round(x) for x in res[True]]} local {[round(x) for x in res[False]]}")
    print(f"load average (1, 5, 15 min) before {tuple(round(x, 1) for x in load_before)}, "
          f"after {tuple(round(x, 1) for x in load_after)}; {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
