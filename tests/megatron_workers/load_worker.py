"""One rank of tests/megatron/test_load_transactional.py::test_one_bad_rank_file_changes_no_rank: 2 gloo
ranks (spec['mesh']: TP2 or PP2), tiny Qwen3, fp32. Also the state helpers the single-process
tests of that file use (:func:`snapshot`, :func:`differences`).

Rank 0 trains two steps and saves with optimizer state (per-rank ``optimizer/rank0000r.pt``);
rank 0 then replaces rank 1's file (spec['bad']: a crafted pickle, or rank 0's own file: tensors
of other shapes) and rewrites the manifest's size and sha256 for it, so the manifest check
passes. Each rank trains a third step (the live state now differs from the checkpoint), takes a
snapshot and calls ``load``. Records per rank, in $TWINKLE_TEST_OUT/result<rank>.json: the error
({type, error}), the snapshot differences after it (empty: bit-identical), then whether a good
load of the intact copy and one more step run, and that step's loss with the third step's
before the save's state was left (equal: the load restored the step-2 state).
"""
import copy
import hashlib
import json
import os
import shutil
import sys
import traceback

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import twinkle_megatron as tm  # noqa: E402

OUT = os.environ.get("TWINKLE_TEST_OUT", ".")
VOCAB, B, S = 64, 4, 8
DENSE = {"model_type": "qwen3", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
         "max_position_embeddings": 64, "tie_word_embeddings": False, "rms_norm_eps": 1e-6}


# ---- what a load may change -----------------------------------------------------------------

def snapshot(model, adapter_name=None) -> dict:
    """Copies of everything a load may change: every parameter (LoRA adapters included), each
    inner optimizer's per-parameter state, param groups and (fp32) main params, the LR
    scheduler's state, the counters, and the torch and megatron RNG tracker states."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    state = model.train_state(adapter_name)
    out = {"params": {f"{i}.{n}": p.detach().clone() for i, c in enumerate(model.unwrapped_chunks())
                      for n, p in c.named_parameters()},
           "counters": {k: getattr(state, k) for k in ("cur_step", "consumed_train_samples", "accumulated_calls")},
           "rng": {"torch": torch.get_rng_state(),
                   **{f"tracker.{k}": v.clone() for k, v in get_cuda_rng_tracker().get_states().items()}}}
    if state.optimizer is not None:
        opts = getattr(state.optimizer, "chained_optimizers", [state.optimizer])
        out["optimizer"] = [{"state": copy.deepcopy(dict(o.optimizer.state)),
                             "groups": [{k: v for k, v in g.items() if k != "params"}
                                        for g in o.optimizer.param_groups],
                             "main": [p.detach().clone() for g in o.optimizer.param_groups for p in g["params"]]}
                            for o in opts]
        # the state is keyed by parameter objects: compare it in parameter order
        for o, snap in zip(opts, out["optimizer"]):
            order = [p for g in o.optimizer.param_groups for p in g["params"]]
            snap["state"] = [copy.deepcopy(o.optimizer.state.get(p, {})) for p in order]
    if state.lr_scheduler is not None:
        out["scheduler"] = copy.deepcopy(state.lr_scheduler.state_dict())
    return out


def differences(a, b, path="state") -> list:
    """The paths where snapshots ``a`` and ``b`` differ (tensors: bit for bit); [] when identical."""
    if torch.is_tensor(a):
        same = torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [path]
    if isinstance(a, dict):
        if not isinstance(b, dict) or set(a) != set(b):
            return [f"{path} keys {sorted(map(str, a))} != {sorted(map(str, b)) if isinstance(b, dict) else b}"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            return [f"{path} length"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def batch(seed=0, vocab=VOCAB, b=B, s=S):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    labels = ids.clone()
    labels[:, :2] = -100
    return {"input_ids": ids, "labels": labels}


def rehash(path: str, rel: str) -> None:
    """Rewrite ``rel``'s manifest entry to the file as it is now (what an attacker or a buggy
    tool could do): the manifest check then passes, and only what reads the file can refuse it."""
    manifest_file = os.path.join(path, "manifest.json")
    manifest = json.load(open(manifest_file))
    data = open(os.path.join(path, rel), "rb").read()
    manifest["files"][rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    json.dump(manifest, open(manifest_file, "w"))


class Payload:
    """Pickles to a call that writes the marker file: what a crafted checkpoint could carry."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('code ran')",))


# ---- the two-rank scenario -----------------------------------------------------------------

def run(spec, rank):
    mesh = tm.DeviceMesh.from_sizes(world_size=2, **spec["mesh"])
    tm.initialize(mesh)
    root = spec["root"]
    model = tm.MegatronModel(dict(DENSE), device_mesh=mesh, mixed_precision="fp32", seed=7)
    model.set_optimizer("AdamW", lr=1e-2)
    model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=1, num_training_steps=10)
    for step in range(2):
        model.forward_backward(inputs=batch(step))
        model.clip_grad_and_step()
    path = model.save("ckpt", output_dir=root, save_optimizer=True, consumed_train_samples=8)
    good = os.path.join(root, "intact")
    marker = os.path.join(root, "payload_ran")
    if rank == 0:
        shutil.copytree(path, good)
        rel = "optimizer/rank00001.pt"
        if spec["bad"] == "pickle":
            torch.save({"optimizer": Payload(marker)}, os.path.join(path, rel))
        else:   # another rank's state: same structure, other shapes (PP2), or other values (TP2)
            blob = torch.load(os.path.join(path, "optimizer/rank00000.pt"), weights_only=True)
            for snap in blob["optimizer"]:
                snap["main_params"] = [torch.cat([p, p]) for p in snap["main_params"]]
            torch.save(blob, os.path.join(path, rel))
        rehash(path, rel)
    dist.barrier()
    third_loss = model.forward_backward(inputs=batch(2))["loss"]
    model.clip_grad_and_step()
    torch.manual_seed(100 + rank)   # the RNG states differ from the saved ones
    before = snapshot(model)
    rec = {"third_loss": third_loss}
    try:
        model.load(path)
        rec["bad_load"] = "ok"
    except Exception as e:  # recorded; the test asserts on it
        rec["bad_load"] = {"type": type(e).__name__, "error": str(e)}
    rec["differences"] = differences(before, snapshot(model))
    rec["payload_ran"] = os.path.exists(marker)
    progress = model.load(good)
    rec["good_load"] = progress
    rec["good_loss"] = model.forward_backward(inputs=batch(2))["loss"]
    model.clip_grad_and_step()
    return rec


def main():
    spec = json.load(open(sys.argv[1]))
    rank = int(os.environ["RANK"])
    try:
        rec = run(spec, rank)
    except Exception:
        rec = {"crashed": traceback.format_exc()}
        traceback.print_exc()
    with open(os.path.join(OUT, f"result{rank}.json"), "w") as f:
        json.dump(rec, f)
    if dist.is_initialized():
        tm.shutdown()


if __name__ == "__main__":
    main()
