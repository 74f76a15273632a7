"""One rank of tests/megatron/test_recompute.py: activation recompute and DDP overlap on the facade.

For each run of spec['runs'] the same checkpoint is built once per entry of run['configs'] (the
MegatronModel arguments: recompute settings, overlap switches), with a LoRA adapter when
run['lora'], and each model trains three steps on the same batch: the losses and pre-clip grad
norms are recorded, with get_train_configs() and the DDP config megatron got. An overlap run
also records a checksum of the weights after the last step (read outside a forward, as save does)
and whether a second forward_backward before the step is refused; and once, whether megatron's
coalescing handle waits for the asynchronous all-reduces issued in its block.
Results go to $TWINKLE_TEST_OUT/result<rank>.json.
"""
import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402

import twinkle_megatron as tm  # noqa: E402
from tests.megatron_workers.serve import serve  # noqa: E402


def train(model, batch, mbs, steps=3):
    losses, norms = [], []
    for _ in range(steps):
        losses.append(model.forward_backward(inputs=batch, micro_batch_size=mbs)["loss"])
        norms.append(model.clip_grad_and_step(max_grad_norm=1.0))
    return losses, norms


def count_calls(model) -> dict:
    """Module calls during training, by kind: a recomputed module runs again in the backward."""
    from twinkle_megatron.spec import is_gated_delta_net
    calls = {"layer": 0, "core_attention": 0, "gdn": 0, "mlp": 0}

    def counter(kind):
        def hook(*_):
            calls[kind] += 1
        return hook

    for chunk in model.unwrapped_chunks():
        for name, module in chunk.named_modules():
            kind = ("gdn" if is_gated_delta_net(type(module)) else "layer" if name.count(".") == 2
                    and name.startswith("decoder.layers.") else name.rsplit(".", 1)[-1])
            if kind in calls:
                module.register_forward_hook(counter(kind))
    return calls


def coalesced_wait() -> bool:
    """Whether the handle of megatron's coalescing block (as the CPU mode leaves it) waits for an
    asynchronous all-reduce issued inside it, the way ``finish_grad_sync`` uses it: 16 MB, read
    at once after ``wait()`` (a handle that returns without waiting reads it unreduced)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import param_and_grad_buffer as pgb
    group = ps.get_data_parallel_group()
    t = torch.full((1 << 22,), float(dist.get_rank(group) + 1))
    with pgb._coalescing_manager(group, async_ops=True) as cm:
        pgb.torch.distributed.all_reduce(t, group=group, async_op=True)
    cm.wait()
    n = dist.get_world_size(group)
    return bool((t == n * (n + 1) / 2).all())


def run_one(run, spec, data):
    from megatron.core import parallel_state as ps
    mesh = tm.DeviceMesh.from_sizes(**run["mesh"])
    tm.initialize(mesh)
    dp = ps.get_data_parallel_rank()
    rows = data["ids"].shape[0] // mesh.dp_size
    ids = data["ids"][dp * rows:(dp + 1) * rows]
    batch = {"input_ids": ids, "labels": ids.clone()}
    rec = {"ok": True}
    try:
        for name, kwargs in run["configs"].items():
            kwargs = dict(kwargs)
            dist_opt = kwargs.pop("use_distributed_optimizer", False)
            model = tm.MegatronModel(model_id=spec["model_dirs"][run["model"]], device_mesh=mesh,
                                     mixed_precision="fp32", **kwargs)
            if run.get("lora"):
                from peft import LoraConfig
                model.add_adapter_to_model("default", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                                   lora_dropout=run.get("lora_dropout", 0.0)))
            model.set_optimizer("AdamW", lr=1e-2, use_distributed_optimizer=dist_opt)
            calls = count_calls(model)
            losses, norms = train(model, batch, run.get("mbs"))
            r = {"losses": losses, "norms": norms, "configs": model.get_train_configs(), "calls": dict(calls),
                 "ddp": {k: getattr(model.ddp_config, k) for k in (
                     "overlap_grad_reduce", "overlap_param_gather", "bucket_size", "use_distributed_optimizer")},
                 "recompute": [model.config.recompute_granularity, model.config.recompute_method,
                               model.config.recompute_num_layers, model.config.recompute_modules]}
            if run.get("overlap") and "coalesced_wait" not in rec:
                rec["coalesced_wait"] = coalesced_wait()
            if run.get("overlap"):
                # the weights outside a forward, as save / weight sync read them (after the facade
                # finished the in-flight param gathers); then the one-call-per-step rule
                model.get_hf_state_dict(receivers="rank0")
                r["weights"] = sum(float(p.detach().double().sum()) for c in model.unwrapped_chunks()
                                   for p in c.parameters())
                model.forward_backward(inputs=batch, micro_batch_size=run.get("mbs"))
                try:
                    model.forward_backward(inputs=batch, micro_batch_size=run.get("mbs"))
                    r["second_call"] = "accepted"
                except RuntimeError as e:
                    r["second_call"] = str(e)
            rec[name] = r
            del model
    finally:
        tm.shutdown()
    return rec


if __name__ == "__main__":
    serve(run_one, data=True)
