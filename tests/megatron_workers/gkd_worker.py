"""One rank of the GKD layout tests (tests/megatron/test_gkd.py): per run of spec['runs'] one model (its
mesh, fused LM head or not, ``use_twinkle_kernels`` from run['kernels'], default None) and per case of
spec['cases'] one forward_backward with the teacher's top-k (and, with spec['full_vocab'], one with its full-vocabulary logits) and the pre-clip grad norm (``clip_grad_norm(0)`` then ``zero_grad``: the weights never move).
Results go to $TWINKLE_TEST_OUT/result<rank>.json.
"""
import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import twinkle_megatron as tm  # noqa: E402
from tests.megatron_workers.serve import serve  # noqa: E402


def run_one(run, spec, data):
    mesh = tm.DeviceMesh.from_sizes(**run["mesh"])
    tm.initialize(mesh)
    try:
        model = tm.MegatronModel(model_id=spec["model_dir"], device_mesh=mesh, mixed_precision="fp32",
                                 fused_linear_ce=run["fused"], use_twinkle_kernels=run.get("kernels"))
        model.set_optimizer(optimizer_cls="AdamW", lr=1e-3)
        dp, dps = model.data_parallel_rank, mesh.dp_size
        rows = data["ids"].shape[0] // dps
        mine = slice(dp * rows, (dp + 1) * rows)
        inputs = {"input_ids": data["ids"][mine], "labels": data["labels"][mine]}
        rec = {"ok": True}
        for beta, temperature in spec["cases"]:
            model.set_loss("gkd", beta=beta, temperature=temperature)
            out = model.forward_backward(inputs=inputs, micro_batch_size=run.get("mbs"),
                                         teacher_topk_logps=data["t_logps"][mine],
                                         teacher_topk_indices=data["t_ids"][mine])
            norm = model.clip_grad_norm(0)
            model.zero_grad()
            rec[f"{beta}/{temperature}"] = {"loss": out["loss"], "norm": norm, "count": out["count"]}
            if spec.get("full_vocab"):      # the same teacher as full-vocabulary logits [B, S, V]
                out = model.forward_backward(inputs=inputs, micro_batch_size=run.get("mbs"),
                                             teacher_logits=data["t_logits"][mine])
                norm = model.clip_grad_norm(0)
                model.zero_grad()
                rec[f"full/{beta}/{temperature}"] = {"loss": out["loss"], "norm": norm, "count": out["count"]}
        return rec
    finally:
        tm.shutdown()


if __name__ == "__main__":
    serve(run_one, data=True)
