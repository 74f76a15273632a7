"""One rank of tests/megatron/test_reshard.py: resume a run on a different mesh from megatron's sharded
checkpoint (``save(..., save_optimizer=True, sharded=True)``), in one 2-rank launch that
re-initialises the mesh between phases.

1. TP2: a model of random weights writes them out (every later model starts from them), trains
   3 steps and saves sharded; the same for a LoRA adapter on those weights.
2. For each second mesh (PP2; DP2 with the distributed optimizer): 6 uninterrupted steps from
   the initial weights, and 3 steps after resuming the TP2 checkpoint; record losses, lr,
   progress and the final weights' largest relative difference. On PP2 also: the same resume
   without the optimizer state (the control: it must not match); a bf16 checkpoint (2 steps on
   TP2) resumed and saved again, equal tensor for tensor; a crafted common.pt and a flipped
   byte in one torch_dist shard, refused.
3. An MoE model (4 experts): 3 steps under EP2, saved, resumed under TP2 + SP, against 6 steps
   on TP2 + SP; the same for a LoRA adapter on its routed experts (gate_up_proj, down_proj) and
   two attention projections.
4. A 4-layer model: 6 steps under PP2 x VPP2 and under TP2 with use_twinkle_kernels, each saved
   after 3; each resumes the other's checkpoint for 3 more steps.

Results go to $TWINKLE_TEST_OUT/result<rank>.json.
"""
import gc
import json
import os
import shutil
import sys
import traceback

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import twinkle_megatron as tm  # noqa: E402

VOCAB, SEQ, ROWS = 64, 8, 4
CONFIG = {"model_type": "qwen3", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
          "max_position_embeddings": 64, "tie_word_embeddings": False, "rms_norm_eps": 1e-6}
MOE = dict(CONFIG, model_type="qwen3_moe", intermediate_size=48, moe_intermediate_size=24, num_experts=4,
           num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True)
LORA = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "init_lora_weights": False}
MOE_LORA = dict(LORA, target_modules=["q_proj", "o_proj"],
                target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
OUT = os.environ.get("TWINKLE_TEST_OUT", ".")


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    labels = ids.clone()
    labels[step % ROWS, :3] = -100
    return {"input_ids": ids, "labels": labels}


class Payload:
    """Pickles to a call that writes the marker file: what a crafted common.pt could carry."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('code ran')",))


def build(mesh, source, lora=False, distributed=False, precision="fp32", **kwargs):
    """``lora``: False, True (the dense LORA) or an adapter config; ``kwargs``: MegatronModel's."""
    model = tm.MegatronModel(source, device_mesh=mesh, mixed_precision=precision, **kwargs)
    if lora:
        model.add_adapter_to_model("default", dict(LORA if lora is True else lora))
    model.set_optimizer("AdamW", lr=1e-3, use_distributed_optimizer=distributed)
    model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=2, num_training_steps=10)
    return model


def train(model, steps, mbs=None):
    """Train on ``steps``' batches (this rank's data-parallel share; ``mbs``: rows per
    micro-batch); returns [(loss, lr)]."""
    out = []
    dp, r = model.mesh.dp_size, model.data_parallel_rank
    for s in steps:
        b = batch(s)
        n = ROWS // dp
        res = model.forward_backward(inputs={k: v[r * n:(r + 1) * n] for k, v in b.items()}, micro_batch_size=mbs)
        model.clip_grad_and_step(max_grad_norm=1.0)
        out.append((float(res["loss"]), model.current_lr()))
    return out


def weights(model, adapter):
    return {k: v.double().clone() for k, v in model.get_hf_state_dict(adapter_name=adapter)}


def max_rel(a, b):
    assert sorted(a) == sorted(b), (sorted(a)[:4], sorted(b)[:4])
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-30)) for k in a)


def attempt(fn):
    try:
        return {"ok": True, "value": fn()}
    except Exception as e:  # recorded; the test asserts on the message
        return {"ok": False, "type": type(e).__name__, "error": str(e)}


def second_mesh(rec, root, mesh, distributed, corrupt):
    init = os.path.join(root, "init")
    for kind, lora in (("dense", False), ("lora", True)):
        if lora and distributed:
            continue
        adapter = "default" if lora else None
        ref = build(mesh, init, lora, distributed)
        ref_steps = train(ref, range(6))
        ref_w = weights(ref, adapter)
        del ref
        gc.collect()
        resumed = build(mesh, init, lora, distributed)
        progress = resumed.resume_from_checkpoint(os.path.join(root, kind))
        steps = train(resumed, range(3, 6))
        rec[kind] = {"ref": ref_steps, "resumed": steps, "progress": progress,
                     "weights_max_rel": max_rel(weights(resumed, adapter), ref_w)}
        del resumed
        gc.collect()
        if corrupt and not lora:   # the control: the same weights without optimizer / scheduler state
            fresh = build(mesh, init, lora, distributed)
            fresh.resume_from_checkpoint(os.path.join(root, kind), resume_only_model=True)
            train(fresh, range(3, 6))
            rec[kind]["model_only_weights_max_rel"] = max_rel(weights(fresh, adapter), ref_w)
            del fresh
            gc.collect()
    if corrupt:
        bf16_round_trip(rec, root, mesh)
        crafted_common(rec, root, mesh)
        bad = os.path.join(root, "corrupt")
        if dist.get_rank() == 0:
            shutil.rmtree(bad, ignore_errors=True)
            shutil.copytree(os.path.join(root, "dense"), bad)
            shard = sorted(n for n in os.listdir(os.path.join(bad, "dist_ckpt")) if n.endswith(".distcp"))[-1]
            path = os.path.join(bad, "dist_ckpt", shard)
            data = bytearray(open(path, "rb").read())
            data[len(data) // 2] ^= 0xFF
            open(path, "wb").write(bytes(data))
            rec["corrupted_file"] = path
        dist.barrier()
        model = build(mesh, init)
        rec["corrupt"] = attempt(lambda: model.resume_from_checkpoint(bad))


def bf16_round_trip(rec, root, mesh):
    """bf16 (fp32 main params in the optimizer): resumed on this mesh and saved again at once,
    every tensor of the second checkpoint equals the first's (RNG aside, it is per rank)."""
    from megatron.core.dist_checkpointing import load_plain_tensors
    model = build(mesh, os.path.join(root, "init"), precision="bf16")
    model.resume_from_checkpoint(os.path.join(root, "bf16"))
    again = model.save("bf16_again", output_dir=root, save_optimizer=True, sharded=True)
    del model
    gc.collect()
    first = flat(load_plain_tensors(os.path.join(root, "bf16", "dist_ckpt")))
    second = flat(load_plain_tensors(os.path.join(again, "dist_ckpt")))
    def tensor_keys(d):   # (the common scalars megatron merges in are compared by the resume itself)
        return sorted(k for k, v in d.items() if isinstance(v, torch.Tensor) and not k.startswith("rng_state."))
    keys = tensor_keys(first)
    rec["bf16"] = {"keys": keys, "same_keys": keys == tensor_keys(second),
                   "max_abs_diff": max(float((first[k].double() - second[k].double()).abs().max()) for k in keys)}


def flat(tree, prefix=""):
    """``{dotted key: tensor}`` of a nested dict of tensors."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def crafted_common(rec, root, mesh):
    """A common.pt that would run code when unpickled, with a manifest that agrees with it."""
    crafted = os.path.join(root, "crafted")
    marker = os.path.join(root, "code_ran")
    if dist.get_rank() == 0:
        shutil.rmtree(crafted, ignore_errors=True)
        shutil.copytree(os.path.join(root, "dense"), crafted)
        common = os.path.join(crafted, "dist_ckpt", "common.pt")
        torch.save({"optimizer": Payload(marker)}, common)
        from twinkle_megatron.checkpoint import core
        manifest = json.load(open(os.path.join(crafted, core.MANIFEST)))
        manifest["files"]["dist_ckpt/common.pt"] = core.digest_and_sync(common)
        core.write_json(os.path.join(crafted, core.MANIFEST), manifest)
    dist.barrier()
    model = build(mesh, os.path.join(root, "init"))
    rec["crafted"] = attempt(lambda: model.resume_from_checkpoint(crafted))
    rec["crafted"]["code_ran"] = os.path.exists(marker)


def moe(root, rec):
    """An MoE model trained under EP2, resumed under TP2 + SP (every expert split over TP); the
    same for a LoRA adapter on the routed experts (and attention) of those weights."""
    ep2 = tm.DeviceMesh.from_sizes(ep_size=2)
    init = os.path.join(root, "moe_init")
    for kind, lora in (("moe", None), ("moe_lora", MOE_LORA)):
        if lora is None:   # random weights, written out for every later model to start from
            model = build(ep2, dict(MOE))
            model.save("moe_init", output_dir=root)
        else:
            model = build(ep2, init, lora)
        rec[f"ep2_{kind}"] = train(model, range(3))
        model.save(kind, output_dir=root, save_optimizer=True, sharded=True)
        del model
        gc.collect()
    tp2 = tm.DeviceMesh.from_sizes(tp_size=2, sequence_parallel=True)
    rec["tp2"] = {}
    for kind, lora in (("moe", None), ("moe_lora", MOE_LORA)):
        adapter = "default" if lora else None
        ref = build(tp2, init, lora)
        ref_steps = train(ref, range(6))
        ref_w = weights(ref, adapter)
        del ref
        gc.collect()
        resumed = build(tp2, init, lora)
        progress = resumed.resume_from_checkpoint(os.path.join(root, kind))
        rec["tp2"][kind] = {"ref": ref_steps, "resumed": train(resumed, range(3, 6)), "progress": progress,
                            "weights_max_rel": max_rel(weights(resumed, adapter), ref_w),
                            "expert_keys": sorted(k for k in ref_w if ".experts." in k)}
        del resumed
        gc.collect()


def variants(root, rec):
    """A 4-layer model on two layouts that the other phases do not save or resume: PP2 with two
    virtual stages per rank (interleaved schedule, micro-batches of one row; local spec) and TP2
    with use_twinkle_kernels (the twinkle spec). Each trains 6 uninterrupted steps, saving after
    the third; each then resumes the other's checkpoint for steps 3-5."""
    vpp = tm.DeviceMesh.from_sizes(pp_size=2, vpp_size=2)
    init = os.path.join(root, "deep_init")
    layouts = {"vpp2": (vpp, {"use_twinkle_kernels": False}, 1),
               "twinkle": (tm.DeviceMesh.from_sizes(tp_size=2), {"use_twinkle_kernels": True}, None)}
    refs = {}
    for name, (mesh, kwargs, mbs) in layouts.items():
        if name == "vpp2":   # random weights, written out for every later model to start from
            ref = build(mesh, dict(CONFIG, num_hidden_layers=4))
            ref.save("deep_init", output_dir=root)
        else:
            ref = build(mesh, init, **kwargs)
        steps = train(ref, range(3), mbs)
        ref.save(f"deep_{name}", output_dir=root, save_optimizer=True, sharded=True)
        steps += train(ref, range(3, 6), mbs)
        refs[name] = (steps, weights(ref, None))
        del ref
        gc.collect()
    for name, other in (("twinkle", "vpp2"), ("vpp2", "twinkle")):   # (the mesh of the last ref first)
        mesh, kwargs, mbs = layouts[name]
        resumed = build(mesh, init, **kwargs)
        progress = resumed.resume_from_checkpoint(os.path.join(root, f"deep_{other}"))
        ref_steps, ref_w = refs[name]
        rec[name] = {"deep": {"ref": ref_steps, "saved_by": refs[other][0][:3], "resumed": train(resumed, range(3, 6), mbs),
                              "progress": progress, "weights_max_rel": max_rel(weights(resumed, None), ref_w),
                              "chunks": len(resumed.unwrapped_chunks()),
                              "twinkle_modules": sorted({type(m).__name__ for c in resumed.unwrapped_chunks()
                                                         for m in c.modules()
                                                         if type(m).__module__.startswith("twinkle_megatron.layers")})}}
        del resumed
        gc.collect()


def main():
    spec = json.load(open(sys.argv[1]))
    root = spec["root"]
    rec = {}
    try:
        mesh = tm.DeviceMesh.from_sizes(tp_size=2)
        tm.initialize(mesh)
        for kind, lora in (("dense", False), ("lora", True)):
            if lora:
                model = build(mesh, os.path.join(root, "init"), lora)
            else:   # random weights, written out for every later model to start from
                model = build(mesh, dict(CONFIG))
                model.save("init", output_dir=root)
            rec[f"tp2_{kind}"] = train(model, range(3))
            model.save(kind, output_dir=root, save_optimizer=True, sharded=True)
            del model
            gc.collect()
        model = build(mesh, os.path.join(root, "init"), precision="bf16")
        train(model, range(2))
        model.save("bf16", output_dir=root, save_optimizer=True, sharded=True)
        del model
        gc.collect()
        for name, sizes, distributed, corrupt in (("pp2", {"pp_size": 2}, False, True),
                                                  ("dp2_distopt", {"dp_size": 2}, True, False)):
            rec[name] = {}
            second_mesh(rec[name], root, tm.DeviceMesh.from_sizes(**sizes), distributed, corrupt)
        moe(root, rec)
        variants(root, rec)
    except Exception:
        rec["error"] = traceback.format_exc()
    with open(os.path.join(OUT, f"result{dist.get_rank()}.json"), "w") as f:
        json.dump(rec, f)
    sys.exit(1 if "error" in rec else 0)


if __name__ == "__main__":
    main()
