"""One rank of the upstream metric objects' data-parallel test (tests/megatron/test_upstream_metrics.py):
per run of spec['runs'] a model on its mesh with ``add_metric('GRPOMetric')`` and
``add_metric(DPOMetric)``, two GRPO calls and one DPO call on this rank's share of the batch; its
logps, the calls' results and ``calculate_metric()`` go to $TWINKLE_TEST_OUT/result<rank>.json.
"""
import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402
import twinkle_megatron as tm  # noqa: E402
from tests.megatron_workers.serve import serve  # noqa: E402
from twinkle_megatron.training import metrics  # noqa: E402


def run_one(run, spec, data):
    mesh = tm.DeviceMesh.from_sizes(**run["mesh"])
    tm.initialize(mesh)
    try:
        model = tm.MegatronModel(model_id=spec["model_dir"], device_mesh=mesh, mixed_precision="fp32")
        model.set_optimizer("AdamW", lr=1e-3)
        dp, dps = model.data_parallel_rank, mesh.dp_size
        rows = slice(dp * len(data["ids"]) // dps, (dp + 1) * len(data["ids"]) // dps)
        inputs = {"input_ids": data["ids"][rows], "labels": data["labels"][rows]}
        rec = {"ok": True, "rows": [rows.start, rows.stop]}
        model.set_loss("grpo", epsilon=0.1)
        model.add_metric("GRPOMetric", is_training=True, epsilon=0.1)
        outs = [model.forward_backward(inputs=inputs, old_logps=data["old"][rows] * scale,
                                       advantages=data["adv"][rows], return_logps=True, micro_batch_size=1)
                for scale in (1.0, 1.2)]
        model.zero_grad()
        rec["grpo_logps"] = [o["logps"].tolist() for o in outs]
        rec["grpo"] = model.calculate_metric()
        del model.train_state().user_metrics["GRPOMetric"]
        model.set_loss("dpo", beta=0.2)
        model.add_metric(metrics.DPOMetric, beta=0.2)
        out = model.forward_backward(inputs=inputs, ref_logps=data["ref"][rows], return_logps=True,
                                     micro_batch_size=2)
        model.zero_grad()
        rec["dpo_logps"] = out["logps"].tolist()
        rec["dpo"] = model.calculate_metric()
        return rec
    finally:
        tm.shutdown()


if __name__ == "__main__":
    serve(run_one, data=True)
