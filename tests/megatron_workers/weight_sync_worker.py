"""One rank of the multi-process weight-sync test: each run trains 2 steps under its mesh, then
streams ``get_hf_state_dict`` (receivers "all" and "rank0") into a freshly initialised
transformers model, and compares the stream with what ``save()`` wrote. Rank 0 keeps the
transformers logits (and, with pp_size 1, ``MegatronModel.logits``) in ``<name>.pt``."""
import json
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


SAMPLER = 2   # the sync test's third process: ranks 0 and 1 train, rank 2 samples


def _ids(spec):
    return torch.randint(0, spec["vocab"], (2, 16), generator=torch.Generator().manual_seed(7))


def sync_trainer(spec, rank, store, out_dir):
    """Ranks 0-1 (a megatron world of their own, TP2+SP): each run syncs, trains two steps and syncs
    again (a ``same_model`` run syncs the previous run's model, ``syncs`` times) (``spec["syncs"]`` versions), rank 0 keeping ``MegatronModel.logits`` after each sync; then
    a sampler that stops receiving and one that is killed make rank 0's send raise."""
    import time
    import torch.distributed as dist
    from twinkle_megatron import weight_sync as ws
    dist.init_process_group("gloo", store=dist.PrefixStore("trainer", store), rank=rank, world_size=2)
    timeout = spec["sync_timeout"]
    sender = None
    if rank == 0:
        sender = ws.WeightSender(ws.connect(0, 2, store=store, prefix="sync"), dst=1,
                                 bucket_bytes=spec["bucket_bytes"], timeout=timeout)
    record, logits, model = {"ok": True}, {}, None
    for run in spec["sync_runs"]:
        if not run.get("same_model"):
            model = build({"model_dir": spec["model_dir"], "lora": run["lora"]}, spec,
                          tm.DeviceMesh.from_sizes(tp_size=2, sequence_parallel=True))
        sync = ws.TrainerSync(model, sender, adapter_name="default" if run["lora"] else None,
                              merge_lora=run.get("merge", False))
        stats = []
        for i in range(run.get("syncs", spec["syncs"])):
            if i:   # two steps: the warm-up's first one has lr 0
                train(model, spec, 2, start=2 * i)
            s = sync.send()
            out = model.logits(_ids(spec))
            if rank == 0:
                stats.append({"version": s.version, "tensors": s.tensors, "bytes": s.bytes, "buckets": s.buckets})
                logits[s.version] = out
        record[run["name"]] = stats
    # the sampler stops receiving: the send raises after the timeout; rank 1 drains its stream
    for case in ("stalled", "killed"):
        if case == "killed" and rank == 0:
            sender = ws.WeightSender(ws.connect(0, 2, store=store, prefix="killed"), dst=1, timeout=timeout)
            store.set("killed_connected", "1")   # the sampler dies only once both ends are up
        start = time.monotonic()
        try:
            ws.TrainerSync(model, sender).send()
            record[case] = {"raised": False}
        except ws.WeightSyncError as e:
            record[case] = {"raised": True, "error": str(e), "seconds": time.monotonic() - start}
        dist.barrier()   # both trainer ranks finished the stream together
    if rank == 0:
        torch.save(logits, os.path.join(out_dir, "trainer_logits.pt"))
    dist.destroy_process_group()
    return record


def sync_sampler(spec, store, out_dir):
    """Rank 2: a transformers replica (a peft one for the adapter run) fed only by the receiver."""
    import peft
    from twinkle_megatron import weight_sync as ws
    receiver = ws.WeightReceiver(ws.connect(1, 2, store=store, prefix="sync"), src=0, timeout=300)
    record, logits = {"ok": True}, {}
    for run in spec["sync_runs"]:
        hf = _fresh(spec["model_dir"])
        if run["lora"] and not run.get("merge"):
            hf = peft.get_peft_model(hf, peft.LoraConfig(**run["lora"])).eval()
        got = []
        for _ in range(run.get("syncs", spec["syncs"])):
            version = receiver.receive()
            version.apply(hf)
            with torch.no_grad():
                logits[version.version] = hf(_ids(spec)).logits
            got.append({"version": version.version, "parts": [len(p) for p in version.parts],
                        "bytes": version.nbytes})
        record[run["name"]] = got
    # "stalled": never receive again on this group; "killed": connect, then die. The group is held
    # until then: dropped at once, it closes its pairs while the trainer's connectFullMesh may still
    # be completing, which then fails there ("Connection closed by peer") before the kill is tested
    killed = ws.connect(1, 2, store=store, prefix="killed")  # noqa: F841
    store.wait(["killed_connected"])
    torch.save(logits, os.path.join(out_dir, "sampler_logits.pt"))
    with open(os.path.join(out_dir, f"result{SAMPLER}.json"), "w") as f:
        json.dump(record, f)
    os._exit(0)   # killed: the trainer's next send finds no receiver


def sync_main(spec):
    """The three-process sync test: one TCPStore (the launcher's port) for the trainers' world and
    the sync groups."""
    import datetime
    import torch.distributed as dist
    rank, out_dir = int(os.environ["RANK"]), os.environ["TWINKLE_TEST_OUT"]
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), 3, rank == 0,
                          timeout=datetime.timedelta(seconds=120))
    if rank == SAMPLER:
        sync_sampler(spec, store, out_dir)
    record = sync_trainer(spec, rank, store, out_dir)
    with open(os.path.join(out_dir, f"result{rank}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    import sys
    if "sync_runs" in json.load(open(sys.argv[1])):
        sync_main(json.load(open(sys.argv[1])))
    else:
        serve(run_one, rank=True)
