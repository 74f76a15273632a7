"""One rank of tests/test_gdn_context_parallel.py: each run in spec['runs'] trains a hybrid
(Gated DeltaNet) model for ``spec["steps"]`` steps under its mesh, with the local or the twinkle
layer spec and maybe a LoRA adapter, and records the losses, the grad norms, forward_only's
log-probs after training, the GDN module classes and (in ``$TWINKLE_TEST_OUT/weights_<run>_<rank>.pt``) every parameter at the end.
:func:`train` is also the single-process reference the test runs in-process.

``"contiguous": True`` replaces the layer's zigzag segments by contiguous shards (rank r holding
tokens ``[r S/cp, (r + 1) S/cp)`` of each row, which is not what it holds): the run must then
differ from the single-process one, so the test can fail. ``"packing"`` (per row, its samples'
lengths) trains on packed rows (``position_ids`` restarting); ``"shift_boundary": i`` moves packed
boundary ``cu_seqlens[i]`` one token later in what the model sees (not in the loss's segments).
"""
import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402

import twinkle_megatron as tm  # noqa: E402
from tests.megatron_workers.serve import serve  # noqa: E402


def make_batch(step, b, s, vocab, packing=None):
    """``{"input_ids", "labels"}`` [b, s]; with ``packing`` (per row, the lengths of its samples,
    summing to s) also ``position_ids`` restarting at 0 at every sample."""
    g = torch.Generator().manual_seed(3000 + step)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    labels[-1, s // 2:] = -100
    out = {"input_ids": ids, "labels": labels}
    if packing is not None:
        assert len(packing) == b and all(sum(row) == s for row in packing), packing
        out["position_ids"] = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in packing])
    return out


def _batch(step, spec, run):
    packing = run.get("packing")
    seq = sum(packing[0]) if packing else spec["seq"]
    return make_batch(step, spec["batch"], seq, spec["vocab"], packing)


def build(run, spec, mesh):
    model = tm.MegatronModel(run["model_dir"], device_mesh=mesh, mixed_precision="fp32",
                             use_twinkle_kernels=run.get("twinkle", False), **run.get("model_kwargs", {}))
    if run.get("lora"):
        model.add_adapter_to_model("default", run["lora"])
    model.set_optimizer("AdamW", lr=1e-3, eps=spec.get("adam_eps", 1e-8))
    model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=1, num_training_steps=10)
    return model


def train(model, spec, run=None):
    """``spec["steps"]`` forward_backward + clip_grad_and_step calls on the whole batch (CP splits
    the rows, not the batch; ``run["packing"]``: packed rows). Returns (losses, grad norms)."""
    losses, norms = [], []
    for step in range(spec["steps"]):
        out = model.forward_backward(inputs=_batch(step, spec, run or {}), micro_batch_size=spec.get("mbs"))
        norms.append(model.clip_grad_and_step(1.0))
        losses.append(out["loss"])
    return losses, norms


def logps(model, spec, run=None):
    """forward_only's ``[B, S]`` log-probs of the trained model on the first batch (a list), or None
    where this rank gets none."""
    out = model.forward_only(inputs=_batch(0, spec, run or {}), micro_batch_size=spec.get("mbs"))
    return out["logps"].tolist() if torch.is_tensor(out.get("logps")) else None


def weights(model):
    return {f"{i}.{n}": p.detach().clone() for i, chunk in enumerate(model.unwrapped_chunks())
            for n, p in chunk.named_parameters()}


def gdn_kinds(model):
    return sorted({type(m).__name__ for chunk in model.unwrapped_chunks() for m in chunk.modules()
                   if "GatedDeltaNet" in type(m).__name__})


def _contiguous(row_len, cp, rows=1):
    local = row_len // cp
    return [[(b * row_len + r * local, local) for b in range(rows)] for r in range(cp)]


def _shifted(real, index):
    """``packing.packed_seq_params`` with boundary ``cu_seqlens[index]`` one token later: the
    model sees that sample boundary misplaced by one token, the loss does not."""
    def params(cu, device):
        cu = cu.clone()
        cu[index] += 1
        return real(cu, device)
    return params


def run_one(run, spec, rank):
    from twinkle_megatron import packing
    from twinkle_megatron.layers import gated_delta_net as gdn
    mesh = tm.DeviceMesh.from_sizes(**run["mesh"])
    tm.initialize(mesh)
    real, real_params = gdn.zigzag_segments, packing.packed_seq_params
    if run.get("contiguous"):
        gdn.zigzag_segments = _contiguous
    if run.get("shift_boundary") is not None:
        packing.packed_seq_params = _shifted(real_params, run["shift_boundary"])
    rec = {}
    try:
        model = build(run, spec, mesh)
        rec["kinds"] = gdn_kinds(model)
        rec["losses"], rec["norms"] = train(model, spec, run)
        rec["logps"] = logps(model, spec, run)
        if run.get("weights", True):   # (not under TP / PP: each rank holds a part)
            torch.save(weights(model), os.path.join(os.environ["TWINKLE_TEST_OUT"],
                                                    f"weights_{run['name']}_{rank}.pt"))
        rec["ok"] = True
    finally:
        gdn.zigzag_segments, packing.packed_seq_params = real, real_params
        tm.shutdown()
    return rec


if __name__ == "__main__":
    serve(run_one, rank=True)
