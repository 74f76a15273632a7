"""One rank of the MoE aux-loss layout tests (tests/test_moe_aux_loss.py).

For each layout in spec['runs']: build the model from spec['model_dir'] (fp32), run one
forward_backward on this rank's data-parallel share of the batch in spec['data'] and record the
loss, the aux loss, the pre-clip grad norm and an add_metric metric (the mean log-prob) into $TWINKLE_TEST_OUT/result<rank>.json.
"""
import json
import os
import sys
import traceback

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import twinkle_megatron as tm  # noqa: E402


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
        out = model.forward_backward(inputs=share, micro_batch_size=run.get("mbs"))
        norm = model.clip_grad_norm(0)
        model.zero_grad()
        return {"ok": True, "loss": out["loss"], "aux_loss": out["aux_loss"], "norm": norm,
                "mean_logp": out["mean_logp"],
                "metric": model.calculate_metric()["aux_loss"]}
    finally:
        tm.shutdown()


def main():
    spec = json.load(open(sys.argv[1]))
    batch = torch.load(spec["data"])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {}
    for run in spec["runs"]:
        try:
            results[run["name"]] = run_one(run, spec, batch)
        except Exception as e:  # recorded per run; the test asserts on it
            results[run["name"]] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                                    "traceback": traceback.format_exc()}
            traceback.print_exc()
        with open(os.path.join(os.environ["TWINKLE_TEST_OUT"], f"result{rank}.json"), "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
