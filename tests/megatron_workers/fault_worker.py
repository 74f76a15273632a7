"""One rank of the robustness tests (tests/megatron/test_megatron_faults.py) on a tiny Qwen3 built from a
config dict (random weights, no files needed).

spec['mode'] == 'checks': many refusals in one pair of processes. Every check records, per rank,
the error it raised (or 'ok'); a refusal must leave the process group usable, so one launch
serves them all. spec['mode'] == 'fault': rank 1 stops (SIGSTOP) or dies at spec['phase'] and
rank 0 records how long it took to raise; it then exits non-zero like any training script.
Results go to $TWINKLE_TEST_OUT/result<rank>.json.
"""
import datetime
import json
import os
import shutil
import signal
import sys
import time
import traceback

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import twinkle_megatron as tm  # noqa: E402

VOCAB, SEQ, BATCH = 64, 8, 2
CONFIG = {"model_type": "qwen3", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
          "max_position_embeddings": 64, "tie_word_embeddings": False, "rms_norm_eps": 1e-6}
OUT = os.environ.get("TWINKLE_TEST_OUT", ".")


def batch(step, rows=BATCH, seq=SEQ):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (rows, seq), generator=g)
    labels = ids.clone()
    labels[0, :2] = -100
    return {"input_ids": ids, "labels": labels}


def build(mesh_sizes, timeout_s, adapter=None):
    mesh = tm.DeviceMesh.from_sizes(**mesh_sizes)
    tm.initialize(mesh, timeout_s=timeout_s)
    model = tm.MegatronModel(dict(CONFIG), device_mesh=mesh, mixed_precision="fp32")
    if adapter:
        model.add_adapter_to_model("default", adapter)
    model.set_optimizer("AdamW", lr=1e-3)
    model.set_lr_scheduler("ConstantScheduler", num_warmup_steps=0, num_training_steps=10)
    return model


def attempt(rec, name, fn):
    try:
        value = fn()
        rec[name] = {"ok": True, "value": value}
    except Exception as e:  # recorded; the test asserts on the message
        rec[name] = {"ok": False, "type": type(e).__name__, "error": str(e)}


# ---- mode 'checks' -------------------------------------------------------------------------

def input_checks(model, rank, rec):
    good = batch(0)

    def fb(inputs, **kw):
        return model.forward_backward(inputs=inputs, **kw)["loss"]

    def edited(fn, only_rank=None):
        b = {k: v.clone() for k, v in good.items()}
        if only_rank is None or only_rank == rank:
            fn(b)
        return b

    cases = {
        "ids_too_large": edited(lambda b: b["input_ids"].__setitem__((0, 3), VOCAB)),
        "ids_negative": edited(lambda b: b["input_ids"].__setitem__((1, 0), -1)),
        "labels_too_large": edited(lambda b: b["labels"].__setitem__((0, 5), VOCAB + 3)),
        "labels_negative": edited(lambda b: b["labels"].__setitem__((1, 2), -5)),
        "ids_float": {"input_ids": good["input_ids"].float(), "labels": good["labels"]},
        "ids_bool": {"input_ids": good["input_ids"] > 3, "labels": good["labels"]},
        "empty_batch": {k: v[:0] for k, v in good.items()},
        "empty_sequence": {k: v[:, :0] for k, v in good.items()},
        "ids_too_large_on_rank1": edited(lambda b: b["input_ids"].__setitem__((0, 0), VOCAB + 1), only_rank=1),
        "seq_differs_on_rank1": {k: (v[:, :-2] if rank == 1 else v) for k, v in good.items()},
        "ids_differ_on_rank1": edited(lambda b: b["input_ids"].__setitem__((1, 4), (int(b["input_ids"][1, 4]) + 1) % VOCAB),
                                      only_rank=1),
        "labels_differ_on_rank1": edited(lambda b: b["labels"].__setitem__((1, 4), -100), only_rank=1),
        "shape_error_on_rank1": edited(lambda b: b.__setitem__("labels", b["labels"][:, :-1]), only_rank=1),
    }
    for name, inputs in cases.items():
        attempt(rec, name, lambda: fb(inputs))
    attempt(rec, "micro_batch_size_negative", lambda: fb(good, micro_batch_size=-1))
    attempt(rec, "micro_batch_size_zero", lambda: fb(good, micro_batch_size=0))
    attempt(rec, "forward_only_ids_too_large", lambda: model.forward_only(inputs=cases["ids_too_large"])["loss"])
    attempt(rec, "logits_ids_too_large", lambda: model.logits(cases["ids_too_large"]["input_ids"]).shape[0])
    model.zero_grad()
    # the process group and the model are still fine: a normal step
    attempt(rec, "after_errors", lambda: [fb(good), model.clip_grad_and_step(1.0)])


def failed_step_checks(model, rank, rec):
    """A refused step (non-finite grad norm, injected on rank 1 only) must not block the next."""
    model.forward_backward(inputs=batch(1))
    model.clip_grad_and_step(1.0)
    before = [p.detach().clone() for p in model.unwrapped_chunks()[0].parameters()]
    step, lr = model.cur_step, model.current_lr()
    model.forward_backward(inputs=batch(2))
    if rank == 1:
        next(model.unwrapped_chunks()[0].parameters()).main_grad.view(-1)[0] = float("nan")
    attempt(rec, "nan_step", lambda: model.clip_grad_and_step(1.0))
    after = list(model.unwrapped_chunks()[0].parameters())
    rec["unchanged_after_refusal"] = (all(torch.equal(a, b) for a, b in zip(before, after))
                                      and model.cur_step == step and model.current_lr() == lr)
    # the clean norm of the next batch from this state, measured without stepping...
    model.forward_backward(inputs=batch(3))
    attempt(rec, "clean_norm", lambda: model.clip_grad_norm(0.0))
    model.zero_grad()
    # ...equals what the next real step sees
    attempt(rec, "next_step", lambda: [model.forward_backward(inputs=batch(3))["loss"],
                                       model.clip_grad_and_step(1.0)])


class Payload:
    """Pickles to a call that writes the marker file: what a crafted checkpoint could carry."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('code ran')",))


def _rehash(path, rel):
    """An attacker who edits a file can rewrite the manifest too."""
    from twinkle_megatron.checkpoint import core
    manifest = json.load(open(os.path.join(path, core.MANIFEST)))
    manifest["files"][rel] = core.digest_and_sync(os.path.join(path, rel))
    json.dump(manifest, open(os.path.join(path, core.MANIFEST), "w"))


def _flip(path, offset_fraction=0.5):
    data = bytearray(open(path, "rb").read())
    data[int(len(data) * offset_fraction)] ^= 0x40
    open(path, "wb").write(bytes(data))


def _truncate(path, keep=0.5):
    data = open(path, "rb").read()
    open(path, "wb").write(data[:int(len(data) * keep)])


def checkpoint_checks(model, rank, rec, root):
    model.forward_backward(inputs=batch(4))
    model.clip_grad_and_step(1.0)
    older = model.save("older", output_dir=root, save_optimizer=True)
    model.forward_backward(inputs=batch(5))
    model.clip_grad_and_step(1.0)
    good = model.save("good", output_dir=root, save_optimizer=True)
    rec["saved_steps"] = [json.load(open(os.path.join(p, "trainer_state.json")))["cur_step"] for p in (older, good)]
    marker = os.path.join(root, "payload_ran")
    variants = {}

    def variant(name, edit):
        variants[name] = os.path.join(root, name)
        if rank == 0:
            shutil.copytree(good, variants[name])
            edit(variants[name])

    variant("flipped_weights", lambda d: _flip(os.path.join(d, "model-rank00000.safetensors")))
    variant("flipped_optimizer_rank1", lambda d: _flip(os.path.join(d, "optimizer", "rank00001.pt")))
    variant("truncated_optimizer_rank1", lambda d: _truncate(os.path.join(d, "optimizer", "rank00001.pt")))
    variant("truncated_weights", lambda d: _truncate(os.path.join(d, "model-rank00000.safetensors")))
    variant("truncated_config", lambda d: _truncate(os.path.join(d, "config.json")))

    def edit_step(d):
        f = os.path.join(d, "trainer_state.json")
        state = json.load(open(f))
        state["cur_step"] = 7
        json.dump(state, open(f, "w"), indent=2)
    variant("changed_cur_step", edit_step)
    variant("no_manifest", lambda d: os.remove(os.path.join(d, "manifest.json")))

    def plant(d):
        rel = "optimizer/rank00000.pt"
        torch.save({"optimizer": Payload(marker), "lr_scheduler": None, "rng": None}, os.path.join(d, rel))
        _rehash(d, rel)
    variant("pickle_payload", plant)
    # a save killed between its two renames: <name> gone, <name>.old (older) and a complete <name>.tmp
    if rank == 0:
        shutil.copytree(older, os.path.join(root, "swapped.old"))
        shutil.copytree(good, os.path.join(root, "swapped.tmp"))
        shutil.copytree(older, os.path.join(root, "only_old.old"))
        os.makedirs(os.path.join(root, "partial.tmp"))
        shutil.copy(os.path.join(good, "config.json"), os.path.join(root, "partial.tmp"))
    dist.barrier()
    for name, path in variants.items():
        attempt(rec, name, lambda: model.resume_from_checkpoint(path))
    attempt(rec, "swapped", lambda: model.resume_from_checkpoint(os.path.join(root, "swapped")))
    rec["swapped_dirs"] = sorted(n for n in os.listdir(root) if n.startswith("swapped"))
    attempt(rec, "only_old", lambda: model.resume_from_checkpoint(os.path.join(root, "only_old")))
    attempt(rec, "partial", lambda: model.resume_from_checkpoint(os.path.join(root, "partial")))
    attempt(rec, "good", lambda: model.resume_from_checkpoint(good))
    rec["payload_ran"] = os.path.exists(marker)
    attempt(rec, "after_checkpoint_errors", lambda: [model.forward_backward(inputs=batch(6))["loss"],
                                                     model.clip_grad_and_step(1.0)])


def run_checks(spec, rank):
    rec = {}
    start = time.monotonic()
    model = build({"tp_size": 2}, spec["timeout_s"])
    try:
        input_checks(model, rank, rec)
        failed_step_checks(model, rank, rec)
        checkpoint_checks(model, rank, rec, spec["root"])
    finally:
        tm.shutdown()
    # data parallel (TP=1): one rank's bad ids must stop the other too, not leave it waiting
    dp = {}
    model = build({"dp_size": 2}, spec["timeout_s"])
    try:
        attempt(dp, "ids_too_large_on_rank1", lambda: model.forward_backward(
            inputs={k: (v.clamp(max=VOCAB - 1) + (VOCAB if (rank == 1 and k == "input_ids") else 0))
                    for k, v in batch(0).items()})["loss"])
        attempt(dp, "seq_differs_on_rank1_is_fine", lambda: model.forward_backward(
            inputs={k: (v[:, :-2] if rank == 1 else v) for k, v in batch(0).items()})["loss"])
    finally:
        tm.shutdown()
    rec["dp"] = dp
    # a LoRA adapter checkpoint goes through the same verification and weights_only loading
    lora = {}
    model = build({"tp_size": 2}, spec["timeout_s"],
                  adapter={"r": 2, "lora_alpha": 4, "target_modules": "all-linear"})
    try:
        model.forward_backward(inputs=batch(7))
        model.clip_grad_and_step(1.0)
        path = model.save("adapter", output_dir=spec["root"], save_optimizer=True)
        evil = os.path.join(spec["root"], "adapter_payload")
        marker = os.path.join(spec["root"], "adapter_payload_ran")
        flipped = os.path.join(spec["root"], "adapter_flipped")
        if rank == 0:
            shutil.copytree(path, evil)
            torch.save({"optimizer": Payload(marker)}, os.path.join(evil, "optimizer", "rank00001.pt"))
            _rehash(evil, "optimizer/rank00001.pt")
            shutil.copytree(path, flipped)
            _flip(os.path.join(flipped, "adapter_model.safetensors"))
        dist.barrier()
        attempt(lora, "good", lambda: model.resume_from_checkpoint(path))
        attempt(lora, "pickle_payload", lambda: model.resume_from_checkpoint(evil))
        attempt(lora, "flipped_weights", lambda: model.resume_from_checkpoint(flipped))
        lora["payload_ran"] = os.path.exists(marker)
    finally:
        tm.shutdown()
    rec["lora"] = lora
    rec["seconds"] = time.monotonic() - start
    return rec


# ---- mode 'fault' ------------------------------------------------------------------------------

def fault_now(kind):
    with open(os.path.join(OUT, "fault_time"), "w") as f:
        f.write(repr(time.time()))
    if kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        os._exit(17)


def run_fault(spec, rank):
    phase, kind = spec["phase"], spec["kind"]
    model = build(spec.get("mesh", {"tp_size": 2}), spec["timeout_s"])
    model.forward_backward(inputs=batch(0))
    model.clip_grad_and_step(1.0)
    faulty = rank == 1
    rec = {"entered": None}
    if phase == "forward_backward" and faulty:   # inside the forward, between TP all-reduces
        layer = model.unwrapped_chunks()[0].decoder.layers[-1]
        layer.register_forward_pre_hook(lambda *a: fault_now(kind))
    try:
        rec["entered"] = time.time()
        model.forward_backward(inputs=batch(1))
        if phase == "step" and faulty:
            fault_now(kind)
        rec["entered"] = time.time()
        model.clip_grad_and_step(1.0)
        if phase == "save":
            # a complete checkpoint first; rank 1 then fails part-way through overwriting it
            # (its optimizer file written, the others' not yet gathered)
            model.save("ckpt", output_dir=spec["root"], save_optimizer=True)
            if faulty:
                from twinkle_megatron.checkpoint import core
                real = core.save_rank_state

                def write_then_fault(*args):
                    out = real(*args)
                    fault_now(kind)
                    return out
                core.save_rank_state = write_then_fault
            model.forward_backward(inputs=batch(2))
            model.clip_grad_and_step(1.0)
        rec["entered"] = time.time()
        model.save("ckpt", output_dir=spec["root"], save_optimizer=True)
        rec["finished"] = True
    except Exception as e:
        rec.update(raised=time.time(), error=f"{type(e).__name__}: {e}"[:2000])
        raise
    finally:
        with open(os.path.join(OUT, f"result{rank}.json"), "w") as f:
            json.dump(rec, f)
    return rec


def main():
    spec = json.load(open(sys.argv[1]))
    rank = int(os.environ["RANK"])
    # The caller's own default group (as in a script that set up torch.distributed itself), with a
    # timeout far above spec['timeout_s']: the bound must come from the groups initialize makes.
    # (spec['own_group']: initialize creates the default group itself, with timeout_s.)
    if not spec.get("own_group"):
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    if spec["mode"] == "fault":
        run_fault(spec, rank)
        return
    try:
        rec = run_checks(spec, rank)
    except Exception:
        rec = {"crashed": traceback.format_exc()}
        traceback.print_exc()
    with open(os.path.join(OUT, f"result{rank}.json"), "w") as f:
        json.dump(rec, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
