"""Train a tiny Qwen3 with megatron-core through the twinkle_megatron facade.

    torchrun --nproc_per_node 2 examples/train_megatron.py --tp-size 2
    torchrun --nproc_per_node 2 examples/train_megatron.py --pp-size 2 --mixed-precision fp32
    torchrun --nproc_per_node 2 examples/train_megatron.py --tp-size 2 --lora-rank 8

Runs on CPU (gloo) or GPUs (nccl). The model config is embedded (random init) unless
--model-dir points at a Hugging Face directory (config.json, optionally safetensors weights).
The data is synthetic and learnable: each sample counts upwards from a random start, so the loss
falls quickly. Each rank feeds its own data-parallel share of every global batch. With
--lora-rank only a LoRA adapter on all linear layers trains, and the checkpoint is the adapter in
PEFT format (peft.PeftModel.from_pretrained loads it onto the base model).
"""
import argparse
import logging
import os

from twinkle_megatron import DeviceMesh, MegatronModel, shutdown
from twinkle_megatron.job.data import counting_batches

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
logger = logging.getLogger("train_megatron")

TINY_QWEN3 = {
    "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 128,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}




def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=None)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--pp-size", type=int, default=1)
    p.add_argument("--ep-size", type=int, default=1)
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--mixed-precision", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--lora-rank", type=int, default=0, help="train a LoRA adapter of this rank (0: full)")
    p.add_argument("--lora-alpha", type=float, default=None, help="default 2 * rank")
    p.add_argument("--output-dir", default="output")
    args = p.parse_args()

    device_mesh = DeviceMesh.from_sizes(tp_size=args.tp_size, pp_size=args.pp_size, ep_size=args.ep_size,
                                        sequence_parallel=args.sequence_parallel or None)
    model = MegatronModel(args.model_dir or TINY_QWEN3, device_mesh=device_mesh,
                          mixed_precision=args.mixed_precision)
    if args.lora_rank:
        from peft import LoraConfig
        model.add_adapter_to_model("default", LoraConfig(r=args.lora_rank, target_modules="all-linear",
                                                         lora_alpha=args.lora_alpha or 2 * args.lora_rank))
    model.set_optimizer("AdamW", lr=args.lr)
    model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=5, num_training_steps=args.steps)
    if int(os.environ.get("RANK", "0")) == 0:
        logger.info("train configs:\n%s", model.get_train_configs())

    dataloader = counting_batches(args.steps, args.global_batch, args.seq_len, model.shape.vocab_size,
                                   model.data_parallel_rank, device_mesh.dp_size)
    for step, batch in enumerate(dataloader):
        model.forward_backward(inputs=batch, micro_batch_size=args.micro_batch)
        model.clip_grad_and_step(max_grad_norm=1.0)
        if step % 5 == 0 or step == args.steps - 1:
            metric = model.calculate_metric(is_training=True)
            if int(os.environ.get("RANK", "0")) == 0:
                logger.info(f"step {step} of {args.steps}, metric: {metric}")
    path = model.save("last-checkpoint", output_dir=args.output_dir, save_optimizer=True,
                      consumed_train_samples=args.steps * args.global_batch)
    if int(os.environ.get("RANK", "0")) == 0:
        logger.info(f"saved {path}")
    shutdown()


if __name__ == "__main__":
    main()
