"""One rank of the multi-process weight-sync test: each run trains 2 steps under its mesh, then
streams ``get_hf_state_dict`` (receivers "all" and "rank0") into a freshly initialised
transformers model, and compares the stream with what ``save()`` wrote. Rank 0 keeps the
transformers logits (and, with pp_size 1, ``MegatronModel.logits``) in ``<name>.pt``."""
import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402

import twinkle_megatron as tm  # noqa: E402
from tests.megatron_workers.lora_worker import build, train  # noqa: E402
from tests.megatron_workers.serve import serve  # noqa: E402
from twinkle_megatron.weight_sync import load_hf_weights  # noqa: E402


def _fresh(model_dir):
    import transformers
    torch.manual_seed(123)
    cfg = transformers.AutoConfig.from_pretrained(model_dir)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def saved_tensors(path):
    """Every tensor of the ``*.safetensors`` files in ``path`` (what ``save()`` wrote), by name."""
    from safetensors.torch import load_file
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


def _status_bytes(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _peak_of(consume):
    """Peak resident-set growth (bytes) while ``consume()`` runs: VmHWM, reset through
    /proc/self/clear_refs, minus VmRSS just before (the benchmarks' method)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_bytes("VmRSS")
    consume()
    return _status_bytes("VmHWM") - before


def memory(run, spec):
    """Peak RSS growth of streaming the weights with a consumer that drops each tensor, against a
    consumer that keeps them all (what the method sees for a whole-model copy)."""
    model = tm.MegatronModel(run["config"], device_mesh=tm.DeviceMesh.from_sizes(**run["mesh"]),
                             mixed_precision="fp32")
    sizes = [t.numel() * t.element_size() for _, t in model.get_hf_state_dict()]   # also a warm-up

    def drop():
        for _, t in model.get_hf_state_dict():
            t.add(1)   # touch it: a fresh tensor the size of the one yielded, freed right away

    def keep():
        kept = [t.clone() for _, t in model.get_hf_state_dict()]
        assert len(kept) == len(sizes)
    try:
        stream = _peak_of(drop)
        whole = _peak_of(keep)
    except OSError as e:
        return {"ok": True, "skip": f"cannot reset VmHWM: {e}"}
    return {"ok": True, "stream_peak": stream, "keep_all_peak": whole, "model_bytes": sum(sizes),
            "largest": max(sizes)}


def run_one(run, spec, rank):
    if run.get("memory"):
        return memory(run, spec)
    out_dir = os.environ["TWINKLE_TEST_OUT"]
    model = build(dict(run, lora=None), spec, tm.DeviceMesh.from_sizes(**run["mesh"]))
    train(model, spec, 2)
    hf = _fresh(run["model_dir"])
    loaded = load_hf_weights(hf, model.get_hf_state_dict())
    to_rank0 = list(model.get_hf_state_dict(receivers="rank0"))
    to_replicas = dict(model.get_hf_state_dict(receivers="replicas"))
    everywhere = dict(model.get_hf_state_dict())
    ckpt = model.save(run["name"], output_dir=out_dir)
    ids = torch.randint(0, spec["vocab"], (2, 16), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        got = hf(ids).logits
    record = {"ok": True, "loaded": loaded, "rank0_received": len(to_rank0), "replicas_received": len(to_replicas),
              "replicas_equal": all(torch.equal(t, everywhere[k]) for k, t in to_replicas.items())}
    mesh = run["mesh"]
    ref = model.logits(ids) if mesh.get("pp_size", 1) == 1 and mesh.get("cp_size", 1) == 1 else None
    if rank == 0:
        saved = saved_tensors(ckpt)
        stream = dict(to_rank0)
        record["equal_to_save"] = sorted(stream) == sorted(saved) and all(
            torch.equal(stream[k], v) for k, v in saved.items())
        torch.save({"logits": got, "megatron": ref}, os.path.join(out_dir, run["name"] + ".pt"))
    return record


if __name__ == "__main__":
    serve(run_one, rank=True)
