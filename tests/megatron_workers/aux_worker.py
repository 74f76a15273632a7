"""One rank of the MoE aux-loss layout tests (tests/megatron/test_moe_aux_loss.py).

For each layout in spec['runs']: build the model from spec['model_dir'] (fp32), run one
forward_only and one forward_backward on this rank's data-parallel share of the batch in spec['data'] and record the
loss, the aux loss, the pre-clip grad norm and an add_metric metric (the mean log-prob) into $TWINKLE_TEST_OUT/result<rank>.json.
"""
import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import twinkle_megatron as tm  # noqa: E402
from tests.megatron_workers.serve import serve  # noqa: E402


def run_one(run, spec, batch):
    mesh = tm.DeviceMesh.from_sizes(**run["mesh"])
    tm.initialize(mesh)
    try:
        model = tm.MegatronModel(spec["model_dir"], device_mesh=mesh, mixed_precision="fp32",
                                 use_twinkle_kernels=run.get("twinkle", False))
        model.set_optimizer("AdamW", lr=1e-3)
        model.add_metric("mean_logp", lambda x: ((x.logps * x.loss_mask).sum(), x.loss_mask.sum()))
        dp, dps = model.data_parallel_rank, mesh.dp_size
        rows = len(batch["input_ids"]) // dps
        share = {k: v[dp * rows:(dp + 1) * rows] for k, v in batch.items()}
        ev = model.forward_only(inputs=share, micro_batch_size=run.get("mbs"))
        out = model.forward_backward(inputs=share, micro_batch_size=run.get("mbs"))
        norm = model.clip_grad_norm(0)
        model.zero_grad()
        return {"ok": True, "loss": out["loss"], "aux_loss": out["aux_loss"], "norm": norm,
                "eval_loss": ev["loss"], "eval_aux_loss": ev["aux_loss"],
                "eval_metric": model.calculate_metric(is_training=False)["aux_loss"],
                "mean_logp": out["mean_logp"],
                "metric": model.calculate_metric()["aux_loss"]}
    finally:
        tm.shutdown()


if __name__ == "__main__":
    serve(run_one, data=True)
