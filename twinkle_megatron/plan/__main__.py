"""``python -m twinkle_megatron.plan``: see :mod:`twinkle_megatron.plan`."""
from __future__ import annotations

import argparse
import sys

from .. import config
from . import plan, report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m twinkle_megatron.plan",
                                description="Per-rank memory of training a Hugging Face model with twinkle_megatron.")
    p.add_argument("--model-id", required=True, help="a directory with config.json (or the config.json itself)")
    for name in ("tp", "pp", "cp", "ep", "dp"):
        p.add_argument(f"--{name}", type=int, default=1)
    p.add_argument("--etp", type=int, default=None, help="expert tensor parallel size (default 1)")
    p.add_argument("--seq-length", type=int, default=4096)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--num-micro-batches", type=int, default=None,
                   help="micro-batches per step (default: --pp, the 1F1B steady state)")
    p.add_argument("--device-memory", type=float, default=80.0, help="GB per device")
    p.add_argument("--mixed-precision", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--use-distributed-optimizer", action="store_true")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--fused-lm-head", action="store_true", help="the fused linear cross-entropy (no logits)")
    p.add_argument("--lora-rank", type=int, default=0, help="LoRA on all linear layers (base frozen)")
    p.add_argument("--recompute-num-layers", type=int, default=1)
    a = p.parse_args(argv)
    hf_config = config.load_hf_config(a.model_id)
    stages = plan(hf_config, tp=a.tp, pp=a.pp, cp=a.cp, ep=a.ep, dp=a.dp, etp=a.etp, seq_length=a.seq_length,
                  micro_batch_size=a.micro_batch_size, num_micro_batches=a.num_micro_batches,
                  mixed_precision=a.mixed_precision, use_distributed_optimizer=a.use_distributed_optimizer,
                  lora_rank=a.lora_rank, sequence_parallel=a.sequence_parallel or None, fused_lm_head=a.fused_lm_head,
                  recompute_num_layers=a.recompute_num_layers)
    shape = config.model_shape(hf_config)
    print(f"{shape.model_type}: {shape.num_layers} layers, hidden {shape.hidden_size}, vocab {shape.vocab_size}"
          + (f", {shape.num_experts} experts top-{shape.moe_topk}" if shape.num_experts else "")
          + f" | tp={a.tp} pp={a.pp} cp={a.cp} ep={a.ep} dp={a.dp} | {a.mixed_precision}, "
          f"{a.micro_batch_size} x {a.seq_length} tokens per micro-batch")
    print(report(stages, a.device_memory))
    return 0


if __name__ == "__main__":
    sys.exit(main())
