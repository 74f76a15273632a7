"""One rank of the upstream-defaults MoE test (tests/megatron/test_upstream_mesh.py).

For each run in spec['runs']: build the mesh with ``from_sizes(**run['mesh'])`` (the sizes only,
or with ``etp_size`` / ``sequence_parallel`` given), the fp32 MoE model in spec['model_dir'],
take one AdamW step on this rank's data-parallel share of spec['data'], and record the mesh the
model settled on, the loss and grad norm of the step, the loss after it, and the parameters'
float64 sum of squares (the model's own, to compare runs bit for bit).
"""
import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402
import twinkle_megatron as tm  # noqa: E402
from tests.megatron_workers.serve import serve  # noqa: E402


def run_one(run, spec, batch):
    mesh = tm.DeviceMesh.from_sizes(**run["mesh"])
    tm.initialize(mesh)   # as upstream scripts do before building the model; the model keeps its groups
    try:
        model = tm.MegatronModel(spec["model_dir"], device_mesh=mesh, mixed_precision="fp32",
                                 router_aux_loss_coef=0.0)
        model.set_optimizer("AdamW", lr=1e-2)
        dp, dps = model.data_parallel_rank, model.mesh.dp_size
        rows = len(batch["input_ids"]) // dps
        share = {k: v[dp * rows:(dp + 1) * rows] for k, v in batch.items()}
        out = model.forward_backward(inputs=share)
        norm = model.clip_grad_and_step(max_grad_norm=None)
        after = model.forward_only(inputs=share)
        sq = sum(float(p.detach().double().pow(2).sum()) for c in model.unwrapped_chunks()
                 for p in c.parameters())
        m = model.mesh
        return {"ok": True, "given_sp": mesh.sequence_parallel, "sp": m.sequence_parallel,
                "etp": m.etp_size, "dp": m.dp_size, "config_sp": bool(model.config.sequence_parallel),
                "config_etp": model.config.expert_tensor_parallel_size,
                "loss": out["loss"], "norm": norm, "loss_after": after["loss"], "param_sq": sq}
    finally:
        tm.shutdown()


if __name__ == "__main__":
    serve(run_one, data=True)
