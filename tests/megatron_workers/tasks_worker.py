"""One rank of tests/megatron/test_upstream_tasks.py's parallel runs: per run of spec['runs'] a
model on its mesh, and by ``run["kind"]``: ``"accuracy"``: ``add_metric('Accuracy')``, one
``forward_backward`` on this rank's data-parallel share of the batch, its result and
``calculate_metric()``; ``"embedding"``: ``forward_only(task='embedding')`` then one
``forward_backward(task='embedding')`` with ``set_loss('InfonceLoss', **run["loss"])`` and
``add_metric('EmbeddingMetric')`` on this rank's share of the sentences, the pre-clip grad norm
and ``calculate_metric()``. Results go to $TWINKLE_TEST_OUT/result<rank>.json.
"""
import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import twinkle_megatron as tm  # noqa: E402
from tests.megatron_workers.serve import serve  # noqa: E402


def dp_rows(model, mesh, n):
    dp = model.data_parallel_rank
    return slice(dp * n // mesh.dp_size, (dp + 1) * n // mesh.dp_size)


def accuracy(run, spec, data):
    mesh = tm.DeviceMesh.from_sizes(**run["mesh"])
    tm.initialize(mesh)
    try:
        model = tm.MegatronModel(model_id=spec["model_dir"], device_mesh=mesh, mixed_precision="fp32",
                                 fused_linear_ce=run["fused"])
        model.set_optimizer("AdamW", lr=1e-3)
        model.add_metric("Accuracy")
        rows = dp_rows(model, mesh, len(data["ids"]))
        out = model.forward_backward(inputs={"input_ids": data["ids"][rows], "labels": data["labels"][rows]},
                                     micro_batch_size=1)
        return {"ok": True, "call": {k: out[k] for k in ("accuracy", "correct_tokens", "total_tokens")},
                "metric": model.calculate_metric()}
    finally:
        tm.shutdown()


def embedding(run, spec, data):
    mesh = tm.DeviceMesh.from_sizes(**run["mesh"])
    tm.initialize(mesh)
    try:
        model = tm.MegatronModel(model_id=spec["model_dir"], device_mesh=mesh, mixed_precision="fp32",
                                 fused_linear_ce=run.get("fused", False))
        model.set_optimizer("AdamW", lr=1e-3)
        samples = data["sentences"]
        rows = dp_rows(model, mesh, len(samples))
        mine = samples[rows]
        emb = model.forward_only(inputs=mine, task="embedding")["embeddings"]
        model.set_loss("InfonceLoss", **run["loss"])
        model.add_metric("EmbeddingMetric")
        res = model.forward_backward(inputs=mine, task="embedding", micro_batch_size=run.get("micro_batch_size"))
        norm = model.clip_grad_and_step(max_grad_norm=None)
        return {"ok": True, "rows": [rows.start, rows.stop], "embeddings": emb.tolist(),
                "call": {k: v for k, v in res.items() if k != "embeddings"}, "grad_norm": norm,
                "metric": model.calculate_metric()}
    finally:
        tm.shutdown()


def run_one(run, spec, data):
    return {"accuracy": accuracy, "embedding": embedding}[run["kind"]](run, spec, data)


if __name__ == "__main__":
    serve(run_one, data=True)
