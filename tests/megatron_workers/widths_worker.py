"""One rank of tests/test_published_widths.py: each run builds one published architecture (cut in
depth) under one mesh and writes what the test judges against transformers.

A run: ``{"name", "model_dir", "mesh", "twinkle": bool, "export": dir or None, "probe": "logits" |
"logps"}``; the batch (``input_ids`` / ``labels`` [B, S]) is ``spec["batches"][model_dir]``, a
file the test wrote. Rank 0 writes ``<out>/<name>.pt``: the probe (fp32 logits [B, S, V] with
pipeline size 1, else per-token log-probs [B, S] of the labels from ``forward_only``), the first
training step's loss and pre-clip grad norm.
"""
import gc
import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402

import twinkle_megatron as tm  # noqa: E402
from tests.megatron_workers.serve import serve  # noqa: E402


def run_one(run, spec, rank):
    mesh = tm.DeviceMesh.from_sizes(**run["mesh"])
    tm.initialize(mesh)
    try:
        batch = torch.load(spec["batches"][run["model_dir"]])
        model = tm.MegatronModel(run["model_dir"], device_mesh=mesh, mixed_precision="fp32",
                                 use_twinkle_kernels=run["twinkle"])
        if run.get("export"):
            model.save(os.path.basename(run["export"]), output_dir=os.path.dirname(run["export"]))
        out = {}
        if run["probe"] == "logits":
            out["logits"] = model.logits(batch["input_ids"])
        else:
            out["logps"] = model.forward_only(inputs=batch, return_logps=True)["logps"]
        # one training step on this rank's data-parallel share of the batch
        dp, rows = model.data_parallel_rank, len(batch["input_ids"]) // mesh.dp_size
        share = {k: v[dp * rows:(dp + 1) * rows] for k, v in batch.items()}
        model.set_optimizer("AdamW", lr=1e-4)
        out["loss"] = model.forward_backward(inputs=share)["loss"]
        out["grad_norm"] = model.clip_grad_and_step(1.0)
        if rank == 0:
            torch.save(out, os.path.join(os.environ["TWINKLE_TEST_OUT"], run["name"] + ".pt"))
        rec = {"ok": True, "loss": out["loss"], "grad_norm": out["grad_norm"]}
        del model, out
        gc.collect()
    finally:
        tm.shutdown()
    return rec


if __name__ == "__main__":
    serve(run_one, rank=True)
