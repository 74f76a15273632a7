"""One rank of the return_topk layout tests (tests/megatron/test_return_topk.py): per run of spec['runs']
one model (its mesh, fused LM head or not) and per temperature of spec['temperatures'] one
``forward_only(return_topk=k)``; its topk_logps / topk_indices (every rank's, the whole batch)
go to $TWINKLE_TEST_OUT/result<rank>.json.
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
                                 fused_linear_ce=run["fused"])
        inputs = {"input_ids": data["ids"], "labels": data["labels"]}
        rec = {"ok": True}
        for temperature in spec["temperatures"]:
            out = model.forward_only(inputs=inputs, micro_batch_size=run.get("mbs"), return_topk=spec["k"],
                                     temperature=temperature)
            rec[str(temperature)] = {"logps": out["topk_logps"].tolist(), "ids": out["topk_indices"].tolist(),
                                     "dtype": [str(out["topk_logps"].dtype), str(out["topk_indices"].dtype)]}
        return rec
    finally:
        tm.shutdown()


if __name__ == "__main__":
    serve(run_one, data=True)
