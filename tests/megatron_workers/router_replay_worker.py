"""One rank of the router-replay layout tests (tests/megatron/test_router_replay.py).

Per run of spec['runs'] one model (its mesh, ``model_kwargs``, a LoRA adapter with ``lora``) and
:func:`replay_run`: ``spec['steps']`` training steps (forward_backward with ``routed_experts``, then
clip_grad_and_step) on this rank's data-parallel share of the batch, then forward_only with the
same routing (log-probs) and forward_only recording the routing. A run with ``bad`` passes
``routed_experts`` from ``data[bad]`` and records the error. Results go to
$TWINKLE_TEST_OUT/result<rank>.json. The test runs :func:`replay_run` in its own process too, on the
whole batch: the single-process reference.
"""
import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import twinkle_megatron as tm  # noqa: E402
from tests.megatron_workers.serve import serve  # noqa: E402

LORA = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "init_lora_weights": False}


def build(tm_module, model_dir, mesh=None, model_kwargs=None, lora=False):
    model = tm_module.MegatronModel(model_dir, device_mesh=mesh, mixed_precision="fp32", **(model_kwargs or {}))
    if lora:
        model.add_adapter_to_model("default", dict(LORA))
    model.set_optimizer("AdamW", lr=1e-3, eps=1e-6)  # eps: no sign-like steps on rounding-level grads
    return model


def replay_run(model, data, steps: int, rows: slice, mbs=None, packed: bool = False) -> dict:
    """``steps`` replayed training steps on ``rows`` of the batch, then the replayed log-probs and
    the recorded routing (lists, this rank's rows)."""
    pre = "packed_" if packed else ""
    inputs = {k: data[pre + k][rows] for k in ("input_ids", "labels", "attention_mask", "position_ids")
              if pre + k in data}
    routed = data[pre + "routed"][rows]
    losses, norms = [], []
    for _ in range(steps):
        out = model.forward_backward(inputs=inputs, micro_batch_size=mbs, routed_experts=routed)
        norms.append(float(model.clip_grad_and_step(1e9)))
        losses.append(out["loss"])
    ev = model.forward_only(inputs=inputs, micro_batch_size=mbs, routed_experts=routed)
    rec = model.forward_only(inputs=inputs, micro_batch_size=mbs, return_routed_experts=True)
    return {"loss": losses, "norm": norms, "logps": ev["logps"].tolist(),
            "recorded": rec["routed_experts"].tolist(), "recorded_logps": rec["logps"].tolist()}


def run_one(run, spec, data):
    mesh = tm.DeviceMesh.from_sizes(**run["mesh"])
    tm.initialize(mesh)
    try:
        model = build(tm, spec["model_dir"], mesh, run.get("model_kwargs"), run.get("lora", False))
        dp, dps = model.data_parallel_rank, mesh.dp_size
        n = len(data["input_ids"]) // dps
        rows = slice(dp * n, (dp + 1) * n)
        if run.get("bad"):
            inputs = {"input_ids": data["input_ids"][rows], "labels": data["labels"][rows]}
            model.forward_backward(inputs=inputs, routed_experts=data[run["bad"]][rows])
            return {"ok": True}
        rec = replay_run(model, data, spec["steps"], rows, run.get("mbs"), run.get("packed", False))
        return {"ok": True, "dp": dp, **rec}
    finally:
        tm.shutdown()


if __name__ == "__main__":
    serve(run_one, data=True)
