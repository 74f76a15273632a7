"""One rank of the multi-process multi-adapter tests: adapter ``a`` steps once, then ``b`` is added
(after ``a``'s DDP wrap and optimizer exist) and both train time-shared; :func:`time_shared` is
also the single-process reference the test runs in-process. :func:`mixed_or_time_shared`: ``a``
(cross entropy), ``b`` (GRPO with advantages) and, when the spec has one, ``c`` (cross entropy)
trained on the same rows, either in one mixed batch per step or per adapter.
"""
import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402

import twinkle_megatron as tm  # noqa: E402
from tests.megatron_workers.lora_worker import make_batch  # noqa: E402
from tests.megatron_workers.serve import serve  # noqa: E402


def _share(model, spec, name, step):
    """This rank's data-parallel share of adapter ``name``'s batch ``step``."""
    ids, labels = make_batch(step + (100 if name == "b" else 0), spec["batch"], spec["seq"], spec["vocab"])
    rows = spec["batch"] // model.mesh.dp_size
    sl = slice(model.data_parallel_rank * rows, (model.data_parallel_rank + 1) * rows)
    return {"input_ids": ids[sl], "labels": labels[sl]}


def _add(model, name, lora, dist_opt):
    model.add_adapter_to_model(name, lora)
    model.set_optimizer("AdamW", lr=1e-3, use_distributed_optimizer=dist_opt, adapter_name=name)
    model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=1, num_training_steps=10, adapter_name=name)


def time_shared(model, spec, dist_opt=False):
    """``a`` one step alone, then ``b`` added and 3 steps of both (one clip_grad_and_step for the
    two). Returns {name: [loss, grad norm, loss, grad norm, ...]}."""
    rec = {"a": [], "b": []}
    _add(model, "a", spec["a"], dist_opt)
    rec["a"].append(model.forward_backward(inputs=_share(model, spec, "a", 0), adapter_name="a",
                                           micro_batch_size=spec.get("mbs"))["loss"])
    rec["a"].append(model.clip_grad_and_step(1.0))
    _add(model, "b", spec["b"], dist_opt)
    for step in range(3):
        for name, k in (("a", step + 1), ("b", step)):
            out = model.forward_backward(inputs=_share(model, spec, name, k), adapter_name=name,
                                         micro_batch_size=spec.get("mbs"))
            rec[name].append(out["loss"])
        norms = model.clip_grad_and_step(1.0)
        for name in ("a", "b"):
            rec[name].append(norms[name])
    return rec


SEEDS = {"a": 0, "b": 100, "c": 200}


def adapter_names(spec):
    """The adapters of a mixed spec: ``a``, ``b`` and ``c`` when it has one."""
    return [n for n in SEEDS if n in spec]


def mixed_rows(model, spec, step):
    """This rank's DP share of step ``step``'s rows: the adapters' rows interleaved (a, b[, c], a,
    ...), the names of the rows, and b's advantages (one per b row)."""
    rows = spec["batch"] // model.mesh.dp_size
    sl = slice(model.data_parallel_rank * rows, (model.data_parallel_rank + 1) * rows)
    parts, names = {}, adapter_names(spec)
    for name in names:
        ids, labels = make_batch(step + SEEDS[name], spec["batch"], spec["seq"], spec["vocab"])
        if spec.get("packed"):    # two samples per row, position_ids restarting at 0
            half = spec["seq"] // 2
            parts.setdefault("pos", torch.cat([torch.arange(half), torch.arange(spec["seq"] - half)]))
        parts[name] = (ids[sl], labels[sl])
    adv = torch.linspace(-1.0, 1.5, spec["batch"])[sl] * (1 + step)
    order = names * rows
    k = len(names)
    ids = torch.stack([parts[n][0][i // k] for i, n in enumerate(order)])
    labels = torch.stack([parts[n][1][i // k] for i, n in enumerate(order)])
    batch = {"input_ids": ids, "labels": labels}
    alone = {n: {"input_ids": parts[n][0], "labels": parts[n][1]} for n in names}
    if "pos" in parts:
        batch["position_ids"] = parts["pos"].expand(len(order), -1)
        for n in alone:
            alone[n]["position_ids"] = parts["pos"].expand(rows, -1)
    return batch, order, adv, alone


def mixed_or_time_shared(model, spec, mixed: bool, dist_opt=False):
    """3 steps of ``a``, ``b`` [and ``c``] on :func:`mixed_rows`, in one mixed batch per step
    (``mixed``) or each adapter's rows sent alone. Returns {name: [loss, grad norm, ...]}."""
    names = adapter_names(spec)
    rec = {n: [] for n in names}
    for n in names:
        _add(model, n, spec[n], dist_opt)
    model.set_loss("grpo", adapter_name="b")
    mbs = spec.get("mbs")
    for step in range(3):
        batch, order, adv, alone = mixed_rows(model, spec, step)
        if mixed:
            out = model.forward_backward(inputs=batch, adapter_names=order, advantages=adv_rows(order, adv),
                                         micro_batch_size=mbs)
            for name in names:
                rec[name].append(out[name]["loss"])
        else:
            for name in names:
                rec[name].append(model.forward_backward(inputs=alone[name], adapter_name=name, micro_batch_size=mbs,
                                                        **({"advantages": adv} if name == "b" else {}))["loss"])
        norms = model.clip_grad_and_step(1.0)
        for name in names:
            rec[name].append(norms[name])
    return rec


def adv_rows(order, adv):
    """b's advantages placed on b's rows of the mixed batch (a's rows: ignored, 0)."""
    out = torch.zeros(len(order))
    out[[i for i, n in enumerate(order) if n == "b"]] = adv
    return out


def adapter_counts(model):
    """{adapter name: [trainable, total]} as each adapter counted them when it was added."""
    return {n: [a.trainable_params, a.total_params] for n, a in model.adapters.items()}


def run_one(run, spec):
    mesh = tm.DeviceMesh.from_sizes(**run["mesh"])
    tm.initialize(mesh)
    try:
        model = tm.MegatronModel(run.get("model_dir", spec["model_dir"]), device_mesh=mesh, mixed_precision="fp32",
                                 **run.get("model_kwargs", {}))
        spec = dict(spec, **run.get("spec", {}))
        if run.get("counts_only"):     # the adapters added, nothing trained
            rec = {}
            for name in adapter_names(spec):
                model.add_adapter_to_model(name, spec[name])
        else:
            if run.get("mixed"):
                rec = mixed_or_time_shared(model, spec, True, run.get("dist_opt", False))
            else:
                rec = time_shared(model, spec, run.get("dist_opt", False))
            for name in adapter_names(spec):
                model.save(f"{run['name']}_{name}", output_dir=spec["save_dir"], adapter_name=name)
        rec["counts"] = adapter_counts(model)
        rec["ok"] = True
    finally:
        tm.shutdown()
    return rec


if __name__ == "__main__":
    serve(run_one)
