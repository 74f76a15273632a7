"""One rank of tests/megatron/test_preference_layouts.py: upstream Twinkle's preference losses
(DPO's loss types, reference_free, sft_weight; SimPO, CPO, ORPO) and SAPO under one layout, with
the LM head fused (``use_twinkle_kernels=True``) or not (False).

Per run: one full-model model; per loss case one ``forward_backward`` and the pre-clip grad norm
(``clip_grad_norm(0)``, ``zero_grad``: the weights never move); under DP each rank sends its
share of the rows (consecutive, so preference pairs stay whole). Then, with ``mixed``, a second
model of the same weights with two LoRA adapters ``a`` and ``b`` (optimizers at lr 0, so a step leaves every weight as it was): per
pair of cases one mixed call (``adapter_names``, a's loss on a's rows, b's on b's) and its
per-adapter grad norms, then each adapter's rows alone through the same model. Results go to
$TWINKLE_TEST_OUT/result<rank>.json.
"""
import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402

import twinkle_megatron as tm  # noqa: E402
from tests.megatron_workers.serve import serve  # noqa: E402

NAMES = ["a", "a", "b", "b", "a", "a", "b", "b"]   # the mixed batch's rows: pairs consecutive per adapter


def run_one(run, spec, data):
    mesh = tm.DeviceMesh.from_sizes(**run["mesh"])
    tm.initialize(mesh)
    rec = {}
    try:
        model = tm.MegatronModel(model_id=spec["model_dir"], device_mesh=mesh, mixed_precision="fp32",
                                 use_twinkle_kernels=run["kernels"])
        rec["fused_linear_ce"] = model.fused_linear_ce
        model.set_optimizer("AdamW", lr=1e-3)
        mine = _share(data["ids"].shape[0], model, mesh)
        inputs = {"input_ids": data["ids"][mine], "labels": data["labels"][mine]}
        for case in spec["cases"]:
            model.set_loss(case["loss"], **case["kwargs"])
            out = model.forward_backward(inputs=inputs, micro_batch_size=run.get("mbs"),
                                         **{k: data[k][mine] for k in case["args"]})
            rec[case["id"]] = {"loss": out["loss"], "norm": model.clip_grad_norm(0)}
            model.zero_grad()
        if run.get("mixed"):
            model = tm.MegatronModel(model_id=spec["model_dir"], device_mesh=mesh, mixed_precision="fp32",
                                     use_twinkle_kernels=run["kernels"])
            rec["mixed"] = mixed(model, spec, data, run, _share(len(NAMES), model, mesh))
        rec["ok"] = True
    finally:
        tm.shutdown()
    return rec


def _share(n, model, mesh):
    """This data-parallel rank's slice of ``n`` rows (all of them without DP)."""
    rows = n // mesh.dp_size
    return slice(model.data_parallel_rank * rows, (model.data_parallel_rank + 1) * rows)


def mixed(model, spec, data, run, mine):
    """Per pair of ``spec['mixed']``: the mixed call and each adapter alone, on this rank's ``mine``
    rows of the mixed batch; ``alone_logps`` are those rows' (the loss and norms are over every DP rank)."""
    cases = {c["id"]: c for c in spec["cases"]}
    for name in ("a", "b"):
        model.add_adapter_to_model(name, {"r": 4, "lora_alpha": 8, "target_modules": "all-linear",
                                          "init_lora_weights": False})
        model.set_optimizer("AdamW", lr=0.0, weight_decay=0.0, adapter_name=name)
    ids, labels, names = data["mixed_ids"][mine], data["mixed_labels"][mine], NAMES[mine]
    rows = {n: [i for i, m in enumerate(names) if m == n] for n in ("a", "b")}
    out = {}
    for a_id, b_id in spec["mixed"]:
        by_adapter = {"a": cases[a_id], "b": cases[b_id]}
        for name, case in by_adapter.items():
            model.set_loss(case["loss"], adapter_name=name, **case["kwargs"])
        args = sorted(set(by_adapter["a"]["args"]) | set(by_adapter["b"]["args"]))
        got = model.forward_backward(inputs={"input_ids": ids, "labels": labels}, adapter_names=names,
                                     micro_batch_size=run.get("mixed_mbs"),
                                     **{k: data["mixed_" + k][mine] for k in args})
        norms = model.clip_grad_and_step(None)
        alone, alone_norms = {}, None
        for name, case in by_adapter.items():
            r = rows[name]
            alone[name] = model.forward_backward(
                inputs={"input_ids": ids[r], "labels": labels[r]}, adapter_name=name,
                micro_batch_size=run.get("mixed_mbs"), return_logps=True,
                **{k: data["mixed_" + k][mine][r] for k in case["args"]})
        alone_norms = model.clip_grad_and_step(None)
        out[f"{a_id}+{b_id}"] = {
            n: {"loss": got[n]["loss"], "norm": norms[n], "alone_loss": alone[n]["loss"],
                "alone_norm": alone_norms[n], "alone_logps": alone[n]["logps"].tolist()}
            for n in ("a", "b")}
    return out


if __name__ == "__main__":
    serve(run_one, data=True)
