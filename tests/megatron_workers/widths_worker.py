"""One rank of tests/megatron/test_published_widths.py: each run builds one published architecture (cut in
depth) under one mesh and writes what the test judges against transformers.

A run: ``{"name", "model_dir", "mesh", "twinkle": bool, "round_trip": bool, "probe": "logits" |
"logps"}``; the batch (``input_ids`` / ``labels`` [B, S]) is ``spec["batches"][model_dir]``, a
file the test wrote. Rank 0 writes ``<out>/<name>.pt``:

- ``round_trip`` (when asked): the HF weights the model gives back (``get_hf_state_dict``, the
  tensors ``save`` writes) against the checkpoint it was built from, compared here so that no
  second copy of a multi-GB checkpoint is written: ``{"missing", "extra", "differ"}`` name lists;
- the probe: fp32 logits [B, S, V] (``logits()``, pipeline size 1), or with pipeline size 2 the
  per-token log-probs [B, S] of the labels from the training step's own forward;
- the training step's loss and pre-clip grad norm (``forward_backward`` then ``clip_grad_norm``;
  the optimizer does not step, so no Adam state is allocated: what is judged is all computed
  before the update).

Every run's model is freed before the next (``model_freed`` says whether it was), so a rank
holds one model at a time; ``peak_rss_mb`` is the run's peak resident memory (MB).
"""
import gc
import os
import weakref

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402

import twinkle_megatron as tm  # noqa: E402
from tests.megatron_workers.serve import serve  # noqa: E402


def round_trip(model, rank):
    """Rank 0: which HF tensors the model gives back differ from (or are missing from, or extra
    to) the checkpoint it loaded. Collective: every rank iterates the stream."""
    from safetensors import safe_open
    files = [os.path.join(model.model_dir, f) for f in sorted(os.listdir(model.model_dir))
             if f.endswith(".safetensors")]
    handles = [safe_open(f, framework="pt") for f in files] if rank == 0 else []
    where = {k: h for h in handles for k in h.keys()}
    seen, differ = set(), []
    for name, tensor in model.get_hf_state_dict(receivers="rank0"):
        seen.add(name)
        if name in where and not torch.equal(tensor, where[name].get_tensor(name)):
            differ.append(name)
    return {"missing": sorted(set(where) - seen), "extra": sorted(seen - set(where)), "differ": differ}


def _peak_rss_reset():
    """Start a new peak-RSS window (Linux: clear_refs 5 resets VmHWM); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return None


def run_one(run, spec, rank):
    windowed = _peak_rss_reset()
    mesh = tm.DeviceMesh.from_sizes(**run["mesh"])
    tm.initialize(mesh)
    try:
        batch = torch.load(spec["batches"][run["model_dir"]])
        model = tm.MegatronModel(run["model_dir"], device_mesh=mesh, mixed_precision="fp32",
                                 use_twinkle_kernels=run["twinkle"])
        out = {}
        if run.get("round_trip"):
            out["round_trip"] = round_trip(model, rank)
        if run["probe"] == "logits":
            out["logits"] = model.logits(batch["input_ids"])
        # one training step on this rank's data-parallel share of the batch
        dp, rows = model.data_parallel_rank, len(batch["input_ids"]) // mesh.dp_size
        share = {k: v[dp * rows:(dp + 1) * rows] for k, v in batch.items()}
        model.set_optimizer("AdamW", lr=1e-4)   # clip_grad_norm reads the norm through megatron's optimizer
        res = model.forward_backward(inputs=share, return_logps=run["probe"] == "logps")
        if run["probe"] == "logps":   # pipeline size 2: data-parallel size 1, the share is the batch
            out["logps"] = res["logps"]
        out["loss"] = res["loss"]
        out["grad_norm"] = model.clip_grad_norm(0.0)
        if rank == 0:
            torch.save(out, os.path.join(os.environ["TWINKLE_TEST_OUT"], run["name"] + ".pt"))
        # this run's peak resident memory (the process's own peak where the window cannot be reset)
        rec = {"ok": True, "loss": out["loss"], "grad_norm": out["grad_norm"],
               "peak_rss_mb": _peak_rss_mb(), "peak_rss_windowed": windowed}
        alive = weakref.ref(model)
        del model, out, res
        gc.collect()
        # the next run's memory starts from here: a model kept alive by a reference cycle through
        # autograd's C++ graph (which gc cannot break) would add up over the runs
        rec["model_freed"] = alive() is None
        # what survives (modules imported, their caches) is out of every later collection: a
        # collection of all of it took ~0.35 s, and each run ends with one
        gc.freeze()
    finally:
        tm.shutdown()
    return rec


if __name__ == "__main__":
    serve(run_one, rank=True)
