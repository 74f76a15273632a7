"""Shared parts of the Ascend NPU cookbook scripts (tp_npu.py, tp_moe_npu.py, tp_moe_cp_npu.py).

Each script trains a tiny random-init model for ``--steps`` steps (default 10) through the
``twinkle_megatron`` facade and asserts the loss is finite at every step and lower at the end than
at the start. ``--device npu`` (the default) imports torch_npu explicitly and uses hccl;
``twinkle_megatron.initialize`` applies MindSpeed's megatron adaptor when MindSpeed is installed.
``--device cpu`` runs the same script on CPU under gloo (used by the CPU test of these scripts).
"""
import argparse
import inspect
import logging
import math
import os

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
logger = logging.getLogger("twinkle_npu_cookbook")

TINY_QWEN3 = {
    "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 128,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
TINY_QWEN3_MOE = dict(TINY_QWEN3, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
                      num_hidden_layers=2, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                      norm_topk_prob=True)


def parser(doc: str, **defaults) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--device", default="npu", choices=["npu", "cpu", "cuda"],
                   help="accelerator to train on (cpu: gloo, for testing the script)")
    p.add_argument("--tp-size", type=int, default=defaults.get("tp_size", 1))
    p.add_argument("--pp-size", type=int, default=defaults.get("pp_size", 1))
    p.add_argument("--ep-size", type=int, default=defaults.get("ep_size", 1))
    p.add_argument("--etp-size", type=int, default=1, help="expert tensor parallel size")
    p.add_argument("--cp-size", type=int, default=defaults.get("cp_size", 1))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--mixed-precision", default=None, choices=["bf16", "fp32"],
                   help="default: bf16 on npu/cuda, fp32 on cpu")
    return p


def setup_device(device: str) -> None:
    """Make ``device`` the one twinkle_megatron trains on, or exit saying why it cannot be."""
    if device == "npu":
        from twinkle_kernels.npu import unavailable_reason
        why = unavailable_reason()  # imports torch_npu (registers torch.npu); never on CPU/CUDA runs
        if why:
            raise SystemExit(f"--device npu: {why}")
    from twinkle_megatron.parallel.mesh import device_type
    if device_type() != device:
        raise SystemExit(f"--device {device} asked, but this process would train on {device_type()} "
                         "(hide CUDA devices with CUDA_VISIBLE_DEVICES= for --device cpu)")




def check_losses(losses: list) -> None:
    """The cookbook's pass criterion: every loss finite, the last one lower than the first."""
    if not losses or not all(math.isfinite(x) for x in losses):
        raise AssertionError(f"non-finite loss: {losses}")
    if not losses[-1] < losses[0]:
        raise AssertionError(f"loss did not decrease over {len(losses)} steps: {losses}")


def train(args, config: dict, *, sequence_parallel: bool = False) -> list:
    """Build the model on the mesh, train ``args.steps`` steps, assert the loss; returns the losses."""
    setup_device(args.device)
    from twinkle_megatron import DeviceMesh, MegatronModel, shutdown
    from twinkle_megatron.job.data import counting_batches

    mesh = DeviceMesh.from_sizes(tp_size=args.tp_size, pp_size=args.pp_size, ep_size=args.ep_size,
                                 cp_size=args.cp_size, etp_size=args.etp_size, sequence_parallel=sequence_parallel)
    precision = args.mixed_precision or ("fp32" if args.device == "cpu" else "bf16")
    extra = {}
    if "use_twinkle_kernels" in inspect.signature(MegatronModel).parameters:
        extra["use_twinkle_kernels"] = True  # the twinkle specs: ops dispatch to the npu backend on NPU
    model = MegatronModel(config, device_mesh=mesh, mixed_precision=precision, **extra)
    model.set_optimizer("AdamW", lr=args.lr)
    model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=2, num_training_steps=args.steps)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    losses = []
    for step, batch in enumerate(counting_batches(args.steps, args.global_batch, args.seq_len,
                                                   model.shape.vocab_size, model.data_parallel_rank,
                                                   mesh.dp_size)):
        model.forward_backward(inputs=batch)
        model.clip_grad_and_step(max_grad_norm=1.0)
        metric = model.calculate_metric(is_training=True)
        losses.append(float(metric["loss"]))
        if rank0:
            logger.info("step %d of %d, metric: %s", step, args.steps, metric)
    shutdown()
    check_losses(losses)
    if rank0:
        logger.info("OK: loss finite and decreasing: %.4f -> %.4f", losses[0], losses[-1])
    return losses
