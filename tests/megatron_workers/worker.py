"""One rank of a multi-process megatron test: runs each layout in spec['runs'] in turn.

The process group is created here once and reused: each run initialises megatron's parallel state
for its mesh, trains, and shuts it down. Results go to $TWINKLE_TEST_OUT/result<rank>.json.
"""
import json
import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402

import twinkle_megatron as tm  # noqa: E402
from tests.megatron_workers.serve import serve  # noqa: E402


def make_batch(step, b, s, vocab):
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    labels[-1, s // 2:] = -100
    return ids, labels


def probe_ids(spec):
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, spec["vocab"], (2, spec["seq"]), generator=g)


def hf_reference(model_dir, spec):
    """Loss of transformers' model on batch 0 and its logits on the probe ids (fp32)."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids, labels = make_batch(0, spec["batch"], spec["seq"], spec["vocab"])
    with torch.no_grad():
        loss = float(hf(input_ids=ids, labels=labels).loss)
        logits = hf(input_ids=probe_ids(spec)).logits
    return loss, logits


def run_one(run, spec, rank):
    from megatron.core import parallel_state as ps
    mesh = tm.DeviceMesh.from_sizes(**run["mesh"])
    tm.initialize(mesh)
    rec = {}
    try:
        source = run.get("model_dir", spec["model_dir"])
        if run.get("hf_overrides"):
            cfg = json.load(open(os.path.join(source, "config.json")))
            cfg.update(run["hf_overrides"])
            source = cfg
        model = tm.MegatronModel(source, device_mesh=mesh,
                                 mixed_precision=run.get("mixed_precision", "fp32"))
        if run.get("export_untrained"):
            model.save(os.path.basename(run["export_untrained"]),
                       output_dir=os.path.dirname(run["export_untrained"]))
        model.set_optimizer("AdamW", lr=1e-3, use_distributed_optimizer=run.get("dist_opt", False))
        name, warmup, total = run.get("scheduler", ("CosineWarmupScheduler", 1, 10))
        model.set_lr_scheduler(name, num_warmup_steps=warmup, num_training_steps=total)
        start = 0
        if run.get("resume"):
            rec["progress"] = model.resume_from_checkpoint(run["resume"])
            start = rec["progress"]["cur_step"]
        if run.get("compare_hf"):
            loss, logits = hf_reference(run.get("model_dir", spec["model_dir"]), spec)
            rec["hf_loss"] = loss
            mine = model.logits(probe_ids(spec))
            rec["logits_max_diff"] = float((mine - logits).abs().max())
        if run.get("probe_position_ids"):   # the untrained model's logits of packed probe rows
            pos = torch.tensor(run["probe_position_ids"]).expand(len(probe_ids(spec)), -1)
            rec["packed_logits"] = model.logits(probe_ids(spec), position_ids=pos).tolist()
        dp, dps = model.data_parallel_rank, mesh.dp_size
        assert dp == ps.get_data_parallel_rank()
        if run.get("eval_first"):
            ids, labels = make_batch(start, spec["batch"], spec["seq"], spec["vocab"])
            rows = spec["batch"] // dps
            out = model.forward_only(inputs={"input_ids": ids[dp * rows:(dp + 1) * rows],
                                             "labels": labels[dp * rows:(dp + 1) * rows]},
                                     micro_batch_size=run.get("mbs"))
            rec["eval"] = {k: v for k, v in out.items() if not torch.is_tensor(v)}   # logps: [B, S]
            rec["eval_metric"] = model.calculate_metric(is_training=False)
        losses, norms = [], []
        for step in range(start, start + run["steps"]):
            ids, labels = make_batch(step, spec["batch"], spec["seq"], spec["vocab"])
            rows = spec["batch"] // dps
            if run.get("bad_labels"):
                labels = labels[:, :-1]
            ids, labels = ids[dp * rows:(dp + 1) * rows], labels[dp * rows:(dp + 1) * rows]
            inputs = {"input_ids": ids, "labels": labels}
            if run.get("as_samples"):   # a list of samples: the last one shortened, then padded back
                inputs = [{"input_ids": i.tolist(), "labels": l.tolist()} for i, l in zip(ids, labels)]
                keep = int((labels[-1] != -100).nonzero().max()) + 1
                inputs[-1] = {k: v[:keep] for k, v in inputs[-1].items()}
            if run.get("accumulate"):   # one forward_backward per half batch, then one step
                half = len(ids) // 2
                outs = [model.forward_backward(inputs={k: v[sl] for k, v in inputs.items()},
                                               micro_batch_size=run.get("mbs"))
                        for sl in (slice(0, half), slice(half, None))]
                tokens = sum(o["num_tokens"] for o in outs)
                out = {"loss": sum(o["loss"] * o["num_tokens"] for o in outs) / tokens}
            else:
                out = model.forward_backward(inputs=inputs, micro_batch_size=run.get("mbs"))
            if run.get("kill_rank") == rank and step == start + 1:
                os._exit(17)
            norms.append(model.clip_grad_and_step(1.0))
            rec.setdefault("lrs", []).append(model.current_lr())
            losses.append(out["loss"])
        rec.update(losses=losses, norms=norms, metric=model.calculate_metric(),
                   configs=model.get_train_configs(), lr=model.current_lr())
        if run.get("crash_in_save"):
            import safetensors.torch
            real_save_file = safetensors.torch.save_file

            def save_then_die(*args, **kwargs):   # a crash after the weights hit the disk
                real_save_file(*args, **kwargs)
                os._exit(23)
            safetensors.torch.save_file = save_then_die
        if run.get("save"):
            model.save(os.path.basename(run["save"]), output_dir=os.path.dirname(run["save"]),
                       save_optimizer=True, consumed_train_samples=spec["batch"] * model.cur_step)
        if run.get("probe_logits") and mesh.pp_size == 1:
            rec["probe_logits"] = model.logits(probe_ids(spec)).tolist()
        rec["ok"] = True
    finally:
        tm.shutdown()
    return rec


if __name__ == "__main__":
    serve(run_one, rank=True)
