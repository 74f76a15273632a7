"""One rank of the loss / per-token-output tests (tests/megatron/test_megatron_losses.py).

For each layout in spec['runs'] one model is built and, at the same weights, every check of the
run is made: forward_only logps / entropy, then per loss one forward_backward and the pre-clip
grad norm (``clip_grad_norm(0)`` then ``zero_grad``: the weights never move). The data comes
from spec['data'] (a torch file the test wrote); results go to $TWINKLE_TEST_OUT/result<rank>.json.
"""
import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import twinkle_megatron as tm  # noqa: E402
from tests.megatron_workers.serve import serve  # noqa: E402


def share(t, dp, dps):
    if isinstance(t, list):
        rows = len(t) // dps
        return t[dp * rows:(dp + 1) * rows]
    rows = t.shape[0] // dps
    return t[dp * rows:(dp + 1) * rows]


def run_signatures(run, spec, data, mesh):
    """The user guide's call forms; records what they did."""
    rec = {}
    saved = {k: os.environ.get(k) for k in run["env"]}
    os.environ.update(run["env"])   # read when the model id is resolved, not at import
    try:
        model = tm.MegatronModel(model_id=run["model_id"], device_mesh=mesh,
                                 mixed_precision=run.get("mixed_precision", "fp32"))
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    rec["model_dir"] = model.model_dir
    inputs = {"input_ids": data["ids"], "labels": data["labels"]}
    model.set_optimizer("default", lr=1e-3)
    model.set_optimizer(optimizer_cls="Adam", lr=1e-3, weight_decay=0.0)
    model.set_optimizer(optimizer_cls="AdamW", lr=1e-3, adam_beta2=0.99)
    lrs = {}
    for name, kwargs in run["schedulers"]:
        model.set_lr_scheduler(name, **kwargs) if name == "default" else \
            model.set_lr_scheduler(scheduler_cls=name, **kwargs)
        got = []
        for _ in range(4):
            model.lr_step()
            got.append(model.current_lr())
        lrs[name] = got
    rec["lrs"] = lrs
    model.set_lr_scheduler("constant")
    model.set_loss("GRPOLoss", epsilon=0.2, beta=0.0)
    model.set_loss("cross_entropy")
    steps, losses, norms = [], [], []
    for i in range(4):   # accumulation: a step every second call
        half = slice(0, 2) if i % 2 == 0 else slice(2, 4)
        out = model.forward_backward(inputs={k: v[half] for k, v in inputs.items()})
        norms.append(model.clip_grad_and_step(max_grad_norm=1.0, gradient_accumulation_steps=2))
        steps.append(model.cur_step)
        losses.append(out["loss"])
    rec.update(steps=steps, norms=norms, losses=losses, metric=model.calculate_metric())
    return rec


def run_one(run, spec, data):
    mesh = tm.DeviceMesh.from_sizes(**run["mesh"])
    tm.initialize(mesh)
    rec = {}
    try:
        if run.get("signatures"):
            rec = run_signatures(run, spec, data, mesh)
            rec["ok"] = True
            return rec
        model = tm.MegatronModel(model_id=spec["model_dir"], device_mesh=mesh, mixed_precision="fp32")
        model.set_optimizer(optimizer_cls="AdamW", lr=1e-3)
        dp, dps = model.data_parallel_rank, mesh.dp_size
        inputs = {"input_ids": share(data["ids"], dp, dps), "labels": share(data["labels"], dp, dps)}
        for key in run.get("forward_only", []):
            kind = key
            batch = dict(inputs)
            temperature = 1.0
            if kind == "packed":
                batch = {k: share(data["packed_" + k], dp, dps) for k in ("input_ids", "labels", "position_ids")}
            elif kind == "temperature":
                temperature = 0.7
            out = model.forward_only(inputs=batch, return_logps=True, return_entropy=True,
                                     temperature=temperature, micro_batch_size=run.get("mbs"))
            rec["fo_" + kind] = {"logps": out["logps"].tolist(), "entropy": out["entropy"].tolist(),
                                 "loss": out["loss"]}
        for case in run.get("losses", []):
            name, kwargs = case["loss"], case.get("kwargs", {})
            model.set_loss(name, **kwargs)
            per_sample = {k: share(data[k], dp, dps) for k in case.get("args", [])}
            if case.get("response_only"):
                for k in case["response_only"]:
                    full, mask = per_sample[k], share(data["loss_mask"], dp, dps)
                    per_sample[k] = [row[m].tolist() for row, m in zip(full, mask)]
            if case.get("accumulate"):   # two forward_backward calls, one norm
                half = len(inputs["input_ids"]) // 2
                outs = [model.forward_backward(inputs={k: v[sl] for k, v in inputs.items()},
                                               **{k: v[sl] for k, v in per_sample.items()})
                        for sl in (slice(0, half), slice(half, None))]
                out = {"loss": sum(o["loss"] * o["count"] for o in outs) / sum(o["count"] for o in outs)}
            else:
                out = model.forward_backward(inputs=inputs, micro_batch_size=case.get("mbs"),
                                             return_logps=True, **per_sample)
            norm = model.clip_grad_norm(0)
            model.zero_grad()
            rec[case["id"]] = {"loss": out["loss"], "norm": norm,
                               **{k: v for k, v in out.items() if isinstance(v, float)}}
        for case in run.get("bad", []):   # each must raise, naming the argument
            model.set_loss(case["loss"])
            try:
                model.forward_backward(inputs=inputs, micro_batch_size=case.get("mbs"), **case["args"])
                rec[case["id"]] = {"raised": None}
            except Exception as e:
                rec[case["id"]] = {"raised": type(e).__name__, "message": str(e)}
        if run.get("bad"):   # the errors left nothing behind: a normal step still works
            model.set_loss("cross_entropy")
            rec["after_bad"] = model.forward_backward(inputs=inputs)["loss"]
            model.clip_grad_and_step()
        rec["ok"] = True
    finally:
        tm.shutdown()
    return rec


if __name__ == "__main__":
    serve(run_one, data=True)
