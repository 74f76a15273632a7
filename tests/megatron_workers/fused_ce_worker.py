"""One rank of the fused linear cross-entropy tests of the Megatron facade (tests/megatron/test_megatron_fused_ce.py).

For each layout in spec['runs'] the same checkpoint is built twice, without and with
``fused_linear_ce``, and each model makes the same calls: forward_only logps / entropy (plain at a
temperature, packed rows), one GRPO forward_backward (entropy bonus, so the entropy's gradient
counts) with its pre-clip grad norm (with ``all_losses``: also every other loss), then three cross-entropy training steps (loss and grad norm
of each). A forward hook counts ``output_layer`` calls: the fused model must never run it. A spy
on the fused head's expected-gradient check records whether each cross-entropy backward used the
gradients the head's forward computed.
Results go to $TWINKLE_TEST_OUT/result<rank>.json.
"""
import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import twinkle_megatron as tm  # noqa: E402
from twinkle_kernels.linear_ce import _chunked  # noqa: E402
from tests.megatron_workers.serve import serve  # noqa: E402

GRPO = {"epsilon": 0.2, "epsilon_high": 0.28, "beta": 0.04, "entropy_coef": 0.05}
# the other losses of twinkle_megatron.training.losses: name -> (kwargs, per-sample arguments)
LOSSES = {"dr_grpo": ({"epsilon": 0.2}, ["advantages", "old_logps"]),
          "bnpo": ({"epsilon": 0.2, "beta": 0.1}, ["advantages", "old_logps", "ref_logps"]),
          "gspo": ({"epsilon": 0.1, "epsilon_high": 0.15}, ["advantages", "old_logps"]),
          "cispo": ({"epsilon": 0.2, "epsilon_high": 0.2}, ["advantages", "old_logps"]),
          "dpo": ({"beta": 0.5, "label_smoothing": 0.1}, ["ref_logps"])}


def run_model(run, spec, data, mesh, **build):
    model = tm.MegatronModel(model_id=spec["model_dirs"][run.get("model", "untied")], device_mesh=mesh,
                             mixed_precision=run.get("precision", "fp32"), **build)
    calls = [0]
    for chunk in model.unwrapped_chunks():
        if chunk.post_process:
            chunk.output_layer.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    model.set_optimizer("AdamW", lr=1e-3)
    # whether the fused head's backward used the gradients its forward computed for the expected
    # logps gradient (cross entropy's): one entry per backward that was given that expectation
    used = []
    real_scale = _chunked.logp_scale

    def spy(g, expected):
        s = real_scale(g, expected)
        used.append(s is not None)
        return s
    _chunked.logp_scale = spy
    try:
        return _run_model(run, data, model, calls, used)
    finally:
        _chunked.logp_scale = real_scale


def _run_model(run, data, model, calls, used):
    mbs = run.get("mbs")
    inputs = {"input_ids": data["ids"], "labels": data["labels"]}
    rec = {"fused_linear_ce": model.fused_linear_ce}
    if run.get("logits"):   # logits() keeps running output_layer
        rec["logits"] = model.logits(data["ids"]).tolist()
    out = model.forward_only(inputs=inputs, return_entropy=True, temperature=0.7, micro_batch_size=mbs)
    rec["fo_plain"] = {"logps": out["logps"].tolist(), "entropy": out["entropy"].tolist(), "loss": out["loss"]}
    if run.get("packed", True):
        packed = {k: data["packed_" + k] for k in ("input_ids", "labels", "position_ids")}
        out = model.forward_only(inputs=packed, return_entropy=True, micro_batch_size=mbs)
        rec["fo_packed"] = {"logps": out["logps"].tolist(), "entropy": out["entropy"].tolist(),
                            "loss": out["loss"]}
    model.set_loss("grpo", **GRPO)
    out = model.forward_backward(inputs=inputs, micro_batch_size=mbs, advantages=data["advantages"],
                                 old_logps=data["old_logps"], ref_logps=data["ref_logps"])
    rec["grpo"] = {"loss": out["loss"], "norm": model.clip_grad_norm(0),
                   **{k: v for k, v in out.items() if isinstance(v, float)}}
    rec["grpo_forward_grads"] = list(used)
    model.zero_grad()
    for name, (kwargs, args) in LOSSES.items() if run.get("all_losses") else ():
        model.set_loss(name, **kwargs)
        out = model.forward_backward(inputs=inputs, micro_batch_size=mbs, **{k: data[k] for k in args})
        rec[name] = {"loss": out["loss"], "norm": model.clip_grad_norm(0)}
        model.zero_grad()
    model.set_loss("cross_entropy")
    used.clear()
    losses, norms = [], []
    for _ in range(3):
        losses.append(model.forward_backward(inputs=inputs, micro_batch_size=mbs)["loss"])
        norms.append(model.clip_grad_and_step(max_grad_norm=1.0))
    rec.update(losses=losses, norms=norms, output_layer_calls=calls[0] - bool(run.get("logits")),
               ce_forward_grads=list(used))
    return rec


def run_one(run, spec, data):
    mesh = tm.DeviceMesh.from_sizes(**run["mesh"])
    tm.initialize(mesh)
    try:
        rec = {name: run_model(run, spec, data, mesh, **build) for name, build in (
            ("unfused", {"fused_linear_ce": False}), ("fused", {"fused_linear_ce": True}))}
        if run.get("twinkle_default"):
            rec["twinkle"] = run_model(run, spec, data, mesh, use_twinkle_kernels=True)
        rec["ok"] = True
    finally:
        tm.shutdown()
    return rec


if __name__ == "__main__":
    serve(run_one, data=True)
