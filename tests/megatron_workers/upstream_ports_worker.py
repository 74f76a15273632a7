"""One rank of the hand-written runs that tests/megatron/test_upstream_ports.py compares the ports of upstream's
cookbook (examples/upstream/) with: the same steps written against twinkle_megatron directly, with
this package's own encoding (``set_template`` on the model's folder and ``messages`` inputs) in place
of upstream's Template, Dataset and DataLoader.

spec: ``model_dir``, ``data`` (the self-cognition jsonl), ``name`` / ``author`` (its placeholders'
values), and per run ``mesh`` (from_sizes keywords), ``samples``, ``batch_size``, ``lr``, ``warmup``,
``eval_samples``, ``eval_steps`` (steps after which the port evaluates), ``lora`` (LoraConfig
keywords). Records each step's ``calculate_metric()`` loss and grad norm and each evaluation's loss.
"""
import json
import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import twinkle_megatron as tm  # noqa: E402
from tests.megatron_workers.serve import serve  # noqa: E402


def conversations(spec, n):
    """Upstream's SelfCognitionProcessor, written out: a system turn, the query, the response, with
    {{NAME}} / {{AUTHOR}} filled in."""
    rows = [json.loads(line) for line in open(spec["data"]) if line.strip()][:n]

    def fill(text):
        return text.replace("{{NAME}}", spec["name"]).replace("{{AUTHOR}}", spec["author"])
    return [[{"role": "system", "content": "You are a helpful assistant."},
             {"role": "user", "content": fill(r["query"])},
             {"role": "assistant", "content": fill(r["response"])}] for r in rows]


def dpo_pairs(spec, n):
    """Upstream's EmojiDPOProcessor, written out: (chosen, rejected) conversations of a system turn,
    the prompt and each answer."""
    rows = [json.loads(line) for line in open(spec["data"]) if line.strip()][:n]
    system = {"role": "system", "content": "You are a helpful assistant."}
    return [[[system, {"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r[key]}]
             for key in ("answer_zh", "answer_en")] for r in rows]


def run_dpo(run, spec):
    """dpo_multi_lora.py's loop: per batch of pairs, this rank's contiguous share (upstream's
    DataLoader split), chosen / rejected interleaved, the base model's logps as the reference, a
    step per call with gradient accumulation over ``accumulation`` calls, metrics every
    ``accumulation`` calls."""
    import torch
    from peft import LoraConfig
    from twinkle_megatron.training.losses import DPOLoss
    from twinkle_megatron.training.metrics import DPOMetric
    mesh = tm.DeviceMesh.from_sizes(**run["mesh"])
    tm.initialize(mesh)
    try:
        name, k = "default_0", run["accumulation"]
        model = tm.MegatronModel(spec["model_dir"], device_mesh=mesh)
        model.set_template(spec["model_dir"])
        model.add_adapter_to_model(name, LoraConfig(**run["lora"]), gradient_accumulation_steps=k)
        model.set_optimizer("default", lr=run["lr"], weight_decay=0.01, adapter_name=name)
        model.set_lr_scheduler("default", lr_decay_steps=run["decay_steps"], adapter_name=name)
        model.set_loss(DPOLoss(beta=0.1, loss_type="sigmoid", sft_weight=1.0), adapter_name=name)
        model.add_metric(DPOMetric, beta=0.1, adapter_name=name)
        pairs = dpo_pairs(spec, run["samples"])
        bs, dp = run["batch_size"], model.data_parallel_rank
        batches = [pairs[i:i + bs] for i in range(0, len(pairs) - bs + 1, bs)]   # the last partial one dropped
        # torch's DataLoader draws its iterator's base seed from the global generator, and the LoRA
        # dropout masks come after that draw: the same draw here
        torch.empty((), dtype=torch.int64).random_()
        logged = []
        for i, batch in enumerate(batches, start=1):
            share = batch[mesh.get_slice(len(batch), dp)]
            inputs = [{"messages": c} for pair in share for c in pair]
            ref = model.forward_only(inputs=inputs, adapter_name=None)
            model.forward_backward(inputs=inputs, ref_logps=ref["logps"], adapter_name=name)
            model.clip_grad_and_step(adapter_name=name)
            if i % k == 0:
                logged.append(model.calculate_metric(is_training=True, adapter_name=name))
        return {"ok": True, "metrics": logged}
    finally:
        tm.shutdown()


def run_one(run, spec):
    if run.get("kind") == "dpo":
        return run_dpo(run, spec)
    import torch
    from peft import LoraConfig
    mesh = tm.DeviceMesh.from_sizes(**run["mesh"])
    tm.initialize(mesh)
    try:
        model = tm.MegatronModel(spec["model_dir"], device_mesh=mesh)
        model.set_template(spec["model_dir"])
        model.add_adapter_to_model("default", LoraConfig(**run["lora"]))
        model.set_optimizer("default", lr=run["lr"])
        train = conversations(spec, run["samples"])
        bs = run["batch_size"]
        batches = [train[i:i + bs] for i in range(0, len(train), bs)]
        model.set_lr_scheduler("default", lr_warmup_steps=run["warmup"], lr_decay_steps=len(batches))
        losses, norms, evals = [], [], []
        # torch's DataLoader draws its iterator's base seed from the global generator, which the LoRA
        # dropout masks come from too: the port's draws, once for training and once per evaluation
        torch.empty((), dtype=torch.int64).random_()
        dp = model.data_parallel_rank
        tokens = []
        for step, batch in enumerate(batches):
            # this rank's contiguous share, as upstream's DataLoader splits a batch over the DP ranks
            model.forward_backward(inputs=[{"messages": c} for c in batch[mesh.get_slice(len(batch), dp)]])
            model.clip_grad_and_step()
            m = model.calculate_metric(is_training=True)
            losses.append(m["loss"])
            norms.append(m["grad_norm"])
            tokens.append(m["num_tokens"])
            if step in run["eval_steps"]:
                torch.empty((), dtype=torch.int64).random_()
                held = conversations(spec, run["eval_samples"])
                for i in range(0, len(held), bs):
                    part = held[i:i + bs]
                    model.forward_only(inputs=[{"messages": c} for c in part[mesh.get_slice(len(part), dp)]])
                evals.append(model.calculate_metric(is_training=False)["loss"])
        return {"ok": True, "losses": losses, "grad_norms": norms, "eval_losses": evals, "num_tokens": tokens,
                "sp": model.mesh.sequence_parallel}
    finally:
        tm.shutdown()


if __name__ == "__main__":
    serve(run_one)
