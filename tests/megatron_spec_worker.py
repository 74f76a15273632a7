"""One rank of the spec-equivalence test: for each run, the same tiny model is built twice under one
mesh, with the local layer modules and with twinkle_megatron.spec's twinkle provider, from identical
weights; both train the same batches and the worker records the largest loss / grad / grad-norm gaps.

Results go to $TWINKLE_TEST_OUT/result<rank>.json.
"""
import json
import os
import sys
import traceback

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import twinkle_megatron as tm  # noqa: E402


# Packed rows (b=4, s=16): sample lengths per row, position_ids restarting at 0 for each.
PACKED_LENGTHS = [[5, 11], [16], [3, 1, 12], [9, 7]]


def batch(step, b, s, vocab, packed=False):
    g = torch.Generator().manual_seed(500 + step)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    labels = ids.clone()
    labels[0, :2] = -100
    out = {"input_ids": ids, "labels": labels}
    if packed:
        out["position_ids"] = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in PACKED_LENGTHS])
    return out


def _grads(model):
    out = {}
    for i, chunk in enumerate(model.model):
        for name, p in chunk.named_parameters():
            g = getattr(p, "main_grad", None)
            out[f"{i}.{name}"] = (g if g is not None else p.grad).detach().float().clone()
    return out


def _mlp_groups_are_the_layers(model):
    """Whether every dense MLP of ``model`` (and its two linears) uses its layer's tensor-parallel
    group: before megatron-core 0.18 TransformerLayer passes TwinkleMLP (an MLP subclass) no
    ``tp_group``, warns "Unknown MLP type" (dropped by spec.build_chunks) and MLP falls back to
    parallel_state's group, which must be that one. None for a model without a dense MLP."""
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.transformer_layer import TransformerLayer
    found = []
    for chunk in model.unwrapped_chunks():
        for layer in chunk.modules():
            if isinstance(layer, TransformerLayer) and isinstance(layer.mlp, MLP):
                tp = layer.pg_collection.tp
                found.append(all(m.tp_group is tp for m in (layer.mlp, layer.mlp.linear_fc1, layer.mlp.linear_fc2)))
    return all(found) if found else None


def run_one(run, rank):
    from megatron.core import parallel_state as ps
    mesh = tm.DeviceMesh.from_sizes(**run["mesh"])
    tm.initialize(mesh)
    try:
        prec = run.get("precision", "fp32")
        local = tm.MegatronModel(run["config"], device_mesh=mesh, mixed_precision=prec)
        fused = tm.MegatronModel(run["config"], device_mesh=mesh, mixed_precision=prec,
                                 use_twinkle_kernels=True)
        from twinkle_megatron import spec as specs
        kinds = specs.describe(fused.unwrapped_chunks()[0]) or ""
        with torch.no_grad():
            for a, b in zip(local.unwrapped_chunks(), fused.unwrapped_chunks()):
                pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
                assert pa.keys() == pb.keys(), sorted(set(pa) ^ set(pb))
                for k in pa:
                    pb[k].copy_(pa[k])
        for m in (local, fused):
            m.set_optimizer("AdamW", lr=1e-3)
        rec = {"loss": [], "loss_fused": [], "grad_rel": [], "norm": [], "norm_fused": [], "kinds": kinds,
               "mlp_tp_groups": _mlp_groups_are_the_layers(fused)}
        vocab = run["config"]["vocab_size"]
        dp = ps.get_data_parallel_rank()
        for step in range(run.get("steps", 2)):
            full = batch(step, 4, 16, vocab, packed=run.get("packed", False))
            share = 4 // mesh.dp_size
            mine = {k: v[dp * share:(dp + 1) * share] for k, v in full.items()}
            la = local.forward_backward(inputs=mine)["loss"]
            lb = fused.forward_backward(inputs=mine)["loss"]
            ga, gb = _grads(local), _grads(fused)
            worst = worst_floored = 0.0
            top = max(float(g.abs().max()) for g in ga.values())
            for k in ga:
                scale = max(float(ga[k].abs().max()), 1e-6)
                diff = float((ga[k] - gb[k]).abs().max())
                worst = max(worst, diff / scale)
                # Tensors whose grads are sums with heavy cancellation (the GDN decay parameters
                # A_log / dt_bias: ~1e-5 against ~1 elsewhere) are compared on 1e-3 of the largest
                # grad of the model, so fp32 summation order alone cannot fail them.
                worst_floored = max(worst_floored, diff / max(scale, 1e-3 * top))
            rec["loss"].append(la)
            rec["loss_fused"].append(lb)
            rec["grad_rel"].append(worst)
            rec.setdefault("grad_rel_floored", []).append(worst_floored)
            rec["norm"].append(local.clip_grad_and_step(1.0))
            rec["norm_fused"].append(fused.clip_grad_and_step(1.0))
        return rec
    finally:
        tm.shutdown()


def main():
    spec = json.load(open(sys.argv[1]))
    rank = int(os.environ["RANK"])
    out = {}
    try:
        import datetime
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
        for run in spec["runs"]:
            out[run["name"]] = run_one(run, rank)
    except BaseException:
        out["error"] = traceback.format_exc()
        print(out["error"], file=sys.stderr, flush=True)
    with open(os.path.join(os.environ["TWINKLE_TEST_OUT"], f"result{rank}.json"), "w") as f:
        json.dump(out, f)
    if "error" in out:
        os._exit(1)


if __name__ == "__main__":
    main()
