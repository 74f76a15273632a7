"""One rank of the multi-process LoRA tests: each run in spec['runs'] trains a LoRA adapter (or,
with ``"lora": None``, the full model) under its mesh and records losses, grad norms and the saved
checkpoint; ``"resume"`` continues from one. :func:`train` is also the single-process reference
the tests run in-process.
"""
import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402

import twinkle_megatron as tm  # noqa: E402
from tests.megatron_workers.serve import serve  # noqa: E402


def make_batch(step, b, s, vocab):
    g = torch.Generator().manual_seed(2000 + step)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    labels[-1, s // 2:] = -100
    return ids, labels


def train(model, spec, steps, start=0, calls_per_step=1):
    """``steps`` batches, each split into ``calls_per_step`` forward_backward + clip_grad_and_step
    calls over this rank's data-parallel share. Returns (token-mean losses, grad norms) per batch."""
    dp, dps = model.data_parallel_rank, model.mesh.dp_size
    losses, norms = [], []
    for step in range(start, start + steps):
        ids, labels = make_batch(step, spec["batch"], spec["seq"], spec["vocab"])
        rows = spec["batch"] // dps
        ids, labels = ids[dp * rows:(dp + 1) * rows], labels[dp * rows:(dp + 1) * rows]
        part = rows // calls_per_step
        loss_sum = tokens = 0.0
        for c in range(calls_per_step):
            sl = slice(c * part, (c + 1) * part)
            out = model.forward_backward(inputs={"input_ids": ids[sl], "labels": labels[sl]},
                                         micro_batch_size=spec.get("mbs"))
            loss_sum += out["loss"] * out["num_tokens"]
            tokens += out["num_tokens"]
            norm = model.clip_grad_and_step(1.0)
        losses.append(loss_sum / tokens)
        norms.append(norm)
    return losses, norms


def build(run, spec, mesh):
    model = tm.MegatronModel(run.get("model_dir") or spec["model_dir"], device_mesh=mesh,
                             mixed_precision="fp32", use_twinkle_kernels=run.get("twinkle", False))
    lora = run.get("lora", spec["lora"])
    if lora is not None:
        model.add_adapter_to_model("default", lora, gradient_accumulation_steps=run.get("accumulation", 1))
    model.set_optimizer("AdamW", lr=1e-3, use_distributed_optimizer=run.get("dist_opt", False))
    model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=1, num_training_steps=10)
    return model


def run_one(run, spec):
    mesh = tm.DeviceMesh.from_sizes(**run["mesh"])
    tm.initialize(mesh)
    rec = {}
    try:
        model = build(run, spec, mesh)
        start = 0
        if run.get("resume"):
            name = "default" if model.adapters else None
            start = model.resume_from_checkpoint(run["resume"], adapter_name=name)["cur_step"]
        rec["losses"], rec["norms"] = train(model, spec, run["steps"], start,
                                            calls_per_step=run.get("accumulation", 1))
        if run.get("save"):
            model.save(os.path.basename(run["save"]), output_dir=os.path.dirname(run["save"]),
                       save_optimizer=True, consumed_train_samples=spec["batch"] * model.cur_step)
        rec["ok"] = True
    finally:
        tm.shutdown()
    return rec


if __name__ == "__main__":
    serve(run_one)
