"""One rank of the hand-written runs that tests/test_upstream_ports.py compares the ports of upstream's
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


def run_one(run, spec):
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
        for step, batch in enumerate(batches):
            model.forward_backward(inputs=[{"messages": c} for c in batch])
            model.clip_grad_and_step()
            m = model.calculate_metric(is_training=True)
            losses.append(m["loss"])
            norms.append(m["grad_norm"])
            if step in run["eval_steps"]:
                held = conversations(spec, run["eval_samples"])
                for i in range(0, len(held), bs):
                    model.forward_only(inputs=[{"messages": c} for c in held[i:i + bs]])
                evals.append(model.calculate_metric(is_training=False)["loss"])
        return {"ok": True, "losses": losses, "grad_norms": norms, "eval_losses": evals,
                "sp": model.mesh.sequence_parallel}
    finally:
        tm.shutdown()


if __name__ == "__main__":
    serve(run_one)
