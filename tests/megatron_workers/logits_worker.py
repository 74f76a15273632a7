"""One rank of the return_logits layout tests (tests/megatron/test_return_logits.py): per run of
spec['runs'] one model (its mesh, fused LM head or not), one ``forward_only(return_logits=True)``
on plain rows and one on packed rows; the logits (every rank's, the whole batch) go to
$TWINKLE_TEST_OUT/result<rank>.json.
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
        rec = {"ok": True}
        for kind, inputs in (("plain", {"input_ids": data["ids"], "labels": data["labels"]}),
                             ("packed", {"input_ids": data["p_ids"], "labels": data["p_labels"],
                                         "position_ids": data["p_pos"]})):
            out = model.forward_only(inputs=inputs, micro_batch_size=run.get("mbs"), return_logits=True)
            rec[kind] = {"logits": out["logits"].tolist(), "logps": out["logps"].tolist(),
                         "dtype": str(out["logits"].dtype)}
        return rec
    finally:
        tm.shutdown()


if __name__ == "__main__":
    serve(run_one, data=True)
