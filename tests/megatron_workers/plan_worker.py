"""One rank of tests/megatron/test_plan.py: builds each run's model (optionally with a LoRA adapter) under
its mesh and records this rank's pipeline stage and parameter counts, as megatron holds them:
``dense`` / ``expert`` (megatron's ``local_experts``) base parameters and ``lora`` adapter
parameters."""
import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import twinkle_megatron as tm  # noqa: E402
from tests.megatron_workers.serve import serve  # noqa: E402


def run_one(run, spec):
    from megatron.core import parallel_state as ps
    mesh = tm.DeviceMesh.from_sizes(**run["mesh"])
    tm.initialize(mesh)
    try:
        model = tm.MegatronModel(run["config"], device_mesh=mesh, mixed_precision="fp32")
        if run.get("lora_rank"):
            model.add_adapter_to_model("default", {"r": run["lora_rank"], "lora_alpha": 16,
                                                   "target_modules": "all-linear"})
        rec = {"ok": True, "stage": ps.get_pipeline_model_parallel_rank(), "dense": 0, "expert": 0, "lora": 0}
        for chunk in model.unwrapped_chunks():
            for name, p in chunk.named_parameters():
                key = "lora" if ".lora." in name else ("expert" if ".local_experts." in name else "dense")
                rec[key] += p.numel()
    finally:
        tm.shutdown()
    return rec


if __name__ == "__main__":
    serve(run_one)
