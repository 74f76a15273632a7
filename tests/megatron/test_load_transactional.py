"""``MegatronModel.load`` is all or nothing (twinkle_megatron/checkpoint/core.py: prepare, then
commit), and a model folder's weights are read only in a format that cannot run code.

Each refused load: the error, then every parameter (LoRA included), every optimizer state tensor,
param group and main param, the LR scheduler, the counters and the RNG states bit-identical to a
snapshot taken before the call, then a good load or step that works. One process here (tiny
Qwen3, fp32); two gloo ranks (TP2, PP2) where only rank 1's optimizer file is bad, in
:func:`test_one_bad_rank_file_changes_no_rank` (tests/megatron_workers/load_worker.py).
"""
import json
import os
import shutil

import pytest
import torch

pytest.importorskip("megatron.core")

from conftest import megatron_one_rank  # noqa: E402
from tests.megatron_workers.load_worker import Payload, differences, rehash, snapshot  # noqa: E402
from tests.megatron_workers.protocol import ROOT, launch  # noqa: E402

VOCAB, B, S = 256, 4, 10
LORA = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "init_lora_weights": False}


@pytest.fixture(scope="module")
def one_rank():
    with megatron_one_rank() as tm:
        yield tm


def config(layers=1):
    from twinkle_megatron.job.configs import tiny_qwen3_config
    return tiny_qwen3_config(num_layers=layers)


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    return {"input_ids": ids, "labels": labels}


def make(tm, layers=1, seed=7, lora=False, steps=0, warmup=1, model_id=None):
    m = tm.MegatronModel(model_id=model_id or config(layers), mixed_precision="fp32", seed=seed)
    if lora:
        m.add_adapter_to_model("default", dict(LORA))
    m.set_optimizer("AdamW", lr=1e-2)
    m.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=warmup, num_training_steps=10)
    for i in range(steps):
        m.forward_backward(inputs=batch(i))
        m.clip_grad_and_step()
    return m


def refused(model, error, match, path, **kw):
    """``model.load(path, **kw)`` raises ``error`` matching ``match`` and changes nothing."""
    torch.manual_seed(1234)   # an RNG state that is not the checkpoint's
    before = snapshot(model)
    with pytest.raises(error, match=match):
        model.load(path, **kw)
    assert differences(before, snapshot(model)) == []


def steps_on(model, seed=5):
    """One good step; its loss and grad norm (finite)."""
    out = model.forward_backward(inputs=batch(seed))
    norm = model.clip_grad_and_step()
    assert out["loss"] == out["loss"] and norm == norm
    return out["loss"], norm


def weights(model):
    return {k: v for k, v in snapshot(model)["params"].items()}


# ---- optimizer state asked for and absent ----------------------------------------------------------

@pytest.mark.parametrize("lora", [False, True], ids=["full", "adapter"])
def test_weights_only_checkpoint_with_load_optimizer_true_changes_nothing(one_rank, tmp_path, lora):
    saved = make(one_rank, seed=1, lora=lora, steps=1)
    path = saved.save("weights", output_dir=str(tmp_path))   # no optimizer state
    model = make(one_rank, seed=2, lora=lora, steps=2)
    refused(model, ValueError, "saved without optimizer state .* load_optimizer='if_present'", path)
    # "if_present": the weights only, the optimizer and counters are this run's
    counters = snapshot(model)["counters"]
    assert model.load(path, load_optimizer="if_present") == {"consumed_train_samples": 4, "cur_step": 1}
    loaded = {k: v for k, v in weights(model).items() if not lora or ".lora." in k}
    assert loaded and differences({k: weights(saved)[k] for k in loaded}, loaded) == []
    assert snapshot(model)["counters"] == counters
    steps_on(model)


def test_load_optimizer_must_be_true_false_or_if_present(one_rank, tmp_path):
    model = make(one_rank, steps=1)
    path = model.save("ckpt", output_dir=str(tmp_path), save_optimizer=True)
    at_save = snapshot(model)
    steps_on(model)
    refused(model, ValueError, "load_optimizer must be True, False or 'if_present', got 'yes'", path,
            load_optimizer="yes")
    # "if_present" with the state there: everything back as it was at the save, bit for bit
    assert model.load(path, load_optimizer="if_present") == {"consumed_train_samples": 4, "cur_step": 1}
    assert differences(at_save, snapshot(model)) == []
    steps_on(model)


# ---- a checkpoint that does not fit the model ------------------------------------------------------

def test_one_layer_checkpoint_into_two_layer_model_changes_nothing(one_rank, tmp_path):
    path = make(one_rank, layers=1, steps=1).save("one_layer", output_dir=str(tmp_path), save_optimizer=True)
    model = make(one_rank, layers=2, steps=1)
    refused(model, KeyError, "model.layers.1.* is missing from the Hugging Face checkpoint", path)
    refused(model, KeyError, "is missing", path, load_optimizer=False)
    good = make(one_rank, layers=2, seed=3, steps=2).save("two_layers", output_dir=str(tmp_path),
                                                           save_optimizer=True)
    assert model.load(good)["cur_step"] == 2
    steps_on(model)


def test_scheduler_state_megatron_cannot_read_is_refused_before_any_change(one_rank, tmp_path):
    """megatron's ``load_state_dict`` sets the LR bounds before it reads ``num_steps``: run on a
    copy first, its KeyError changes nothing."""
    model = make(one_rank, steps=2)
    path = model.save("ckpt", output_dir=str(tmp_path), save_optimizer=True)
    rel = "optimizer/rank00000.pt"
    blob = torch.load(os.path.join(path, rel), weights_only=True)
    del blob["lr_scheduler"]["num_steps"]
    blob["lr_scheduler"]["max_lr"] = 0.5
    torch.save(blob, os.path.join(path, rel))
    rehash(path, rel)
    model.forward_backward(inputs=batch(9))
    model.clip_grad_and_step()
    refused(model, ValueError, "LR scheduler state does not fit this run's scheduler: KeyError: 'num_steps'", path)
    steps_on(model)


def test_optimizer_state_of_other_shapes_is_refused_before_any_change(one_rank, tmp_path):
    model = make(one_rank, steps=2)
    path = model.save("ckpt", output_dir=str(tmp_path), save_optimizer=True)
    rel = "optimizer/rank00000.pt"
    blob = torch.load(os.path.join(path, rel), weights_only=True)
    blob["optimizer"][0]["main_params"][-1] = blob["optimizer"][0]["main_params"][-1][:-1].clone()
    torch.save(blob, os.path.join(path, rel))
    rehash(path, rel)
    model.forward_backward(inputs=batch(9))
    model.clip_grad_and_step()
    refused(model, ValueError, "rank00000.pt': optimizer 0 parameter \\d+ is \\(\\(127,\\)", path)
    steps_on(model)


# ---- an optimizer file that weights_only refuses ---------------------------------------------------

@pytest.mark.parametrize("lora", [False, True], ids=["full", "adapter"])
def test_crafted_optimizer_file_with_rehashed_manifest_changes_nothing(one_rank, tmp_path, lora):
    path = make(one_rank, seed=1, lora=lora, steps=1).save("ckpt", output_dir=str(tmp_path), save_optimizer=True)
    marker = str(tmp_path / "payload_ran")
    rel = "optimizer/rank00000.pt"
    torch.save({"optimizer": Payload(marker)}, os.path.join(path, rel))
    rehash(path, rel)
    model = make(one_rank, seed=2, lora=lora, steps=2)
    refused(model, ValueError, "rank00000.pt' holds a type a checkpoint never contains .*weights_only=True", path)
    assert not os.path.exists(marker)
    steps_on(model)


# ---- megatron's sharded format -------------------------------------------------------------------

def rewrite_manifest(path):
    """A manifest for the files ``path`` holds now (as if this directory had been saved so)."""
    for dirpath, _, names in os.walk(path):
        for n in names:
            rel = os.path.relpath(os.path.join(dirpath, n), path)
            if rel != "manifest.json":
                rehash(path, rel)
    manifest = json.load(open(os.path.join(path, "manifest.json")))
    manifest["files"] = {k: v for k, v in manifest["files"].items() if os.path.isfile(os.path.join(path, k))}
    json.dump(manifest, open(os.path.join(path, "manifest.json"), "w"))


def test_sharded_load_refused_after_reading_changes_nothing(one_rank, tmp_path):
    """dist_checkpointing reads into buffers of its own (it would write the live parameters and
    Adam state in place), and the empty Adam state a fresh optimizer gets to read into is removed
    again. Here the HF weights fit and megatron's read of ``dist_ckpt/`` (saved by a model with
    another MLP width) fails: the model is as before, with no optimizer state if it never stepped."""
    path = make(one_rank, steps=2).save("sharded", output_dir=str(tmp_path), save_optimizer=True, sharded=True)
    wide = one_rank.MegatronModel(model_id=dict(config(), intermediate_size=384), mixed_precision="fp32", seed=4)
    wide.set_optimizer("AdamW", lr=1e-2)
    wide.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=1, num_training_steps=10)
    wide.forward_backward(inputs=batch(0))
    wide.clip_grad_and_step()
    other = wide.save("wide", output_dir=str(tmp_path), save_optimizer=True, sharded=True)
    mixed = str(tmp_path / "mixed")
    shutil.copytree(path, mixed)
    shutil.rmtree(os.path.join(mixed, "dist_ckpt"))
    shutil.copytree(os.path.join(other, "dist_ckpt"), os.path.join(mixed, "dist_ckpt"))
    rewrite_manifest(mixed)
    for steps in (0, 1):
        model = make(one_rank, seed=3, steps=steps)
        refused(model, ValueError, "dist_ckpt': megatron's dist_checkpointing cannot read it into this model: "
                "megatron.core.dist_checkpointing.core.CheckpointingException: Global shape mismatch", mixed)
        if steps == 0:
            assert all(not s for s in snapshot(model)["optimizer"][0]["state"])
        steps_on(model)
    resumed = make(one_rank, seed=3)
    assert resumed.load(path) == {"consumed_train_samples": 8, "cur_step": 2}
    steps_on(resumed)


# ---- adapter files ---------------------------------------------------------------------------------

def test_truncated_peft_adapter_file_names_the_file(one_rank, tmp_path):
    peft_dir = tmp_path / "peft"
    saved = make(one_rank, seed=1, lora=True, steps=1).save("adapter", output_dir=str(tmp_path))
    os.makedirs(peft_dir)
    for f in ("adapter_config.json", "adapter_model.safetensors"):   # what peft writes: no manifest
        shutil.copy(os.path.join(saved, f), peft_dir / f)
    weights_file = peft_dir / "adapter_model.safetensors"
    data = weights_file.read_bytes()
    model = make(one_rank, seed=2, lora=True, steps=1)
    for cut in (len(data) // 2, 6):   # inside the tensors, inside the header
        weights_file.write_bytes(data[:cut])
        refused(model, ValueError, f"cannot read adapter weights file '{weights_file}' \\(truncated", str(peft_dir),
                load_optimizer=False)
    weights_file.write_bytes(data)
    # left to its default, a folder peft wrote (no manifest, no trainer state) loads as weights
    # only, as upstream Twinkle's load(adapter_dir, adapter_name=) does; asked for, the optimizer
    # state is still refused before anything changes
    refused(model, ValueError, "optimizer", str(peft_dir), load_optimizer=True)
    model.load(peft_dir.name, adapter_name="default", output_dir=str(peft_dir.parent))
    twin = make(one_rank, seed=3, lora=True, steps=1)
    twin.load(str(peft_dir), load_optimizer=False)
    from twinkle_megatron import lora as tlora
    a, b = (tlora.full_weights(m.adapters["default"]) for m in (model, twin))
    assert a.keys() == b.keys() and all(torch.equal(a[k][i], b[k][i]) for k in a for i in (0, 1))
    steps_on(model)


# ---- model folders -------------------------------------------------------------------------------

def test_model_folder_with_only_pytorch_model_bin_is_an_error_naming_it(one_rank, tmp_path):
    from safetensors.torch import load_file
    source = make(one_rank, seed=11).save("hf", output_dir=str(tmp_path))
    folder = tmp_path / "bin_only"
    os.makedirs(folder)
    shutil.copy(os.path.join(source, "config.json"), folder / "config.json")
    tensors = {}
    for f in json.load(open(os.path.join(source, "model.safetensors.index.json")))["weight_map"].values():
        tensors.update(load_file(os.path.join(source, f)))
    torch.save(tensors, folder / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="no safetensors weights .* it has pytorch_model.bin; .*"
                                                "load_bin_weights=True"):
        one_rank.MegatronModel(model_id=str(folder), mixed_precision="fp32")
    # asked for: read with weights_only=True, the same weights as the safetensors folder's
    from_bin = one_rank.MegatronModel(model_id=str(folder), mixed_precision="fp32", seed=99, load_bin_weights=True)
    from_st = one_rank.MegatronModel(model_id=source, mixed_precision="fp32", seed=98)
    assert differences(weights(from_st), weights(from_bin)) == []
    # a crafted bin is refused, asked for or not
    marker = str(tmp_path / "payload_ran")
    torch.save({"model.embed_tokens.weight": Payload(marker)}, folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pytorch_model.bin' .*weights_only=True"):
        one_rank.MegatronModel(model_id=str(folder), mixed_precision="fp32", load_bin_weights=True)
    assert not os.path.exists(marker)


def test_config_only_folder_is_still_a_random_init(one_rank, tmp_path):
    folder = tmp_path / "config_only"
    os.makedirs(folder)
    json.dump(config(), open(folder / "config.json", "w"))
    a = one_rank.MegatronModel(model_id=str(folder), mixed_precision="fp32", seed=5)
    b = one_rank.MegatronModel(model_id=config(), mixed_precision="fp32", seed=5)
    assert differences(weights(a), weights(b)) == []
    # weights of another format next to the config: an error, unless weights are not loaded at all
    (folder / "model.pt").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="it has model.pt"):
        one_rank.MegatronModel(model_id=str(folder), mixed_precision="fp32")
    one_rank.MegatronModel(model_id=str(folder), mixed_precision="fp32", load_weights=False)


# ---- two ranks -----------------------------------------------------------------------------------

WORKER = os.path.join(ROOT, "tests", "megatron_workers", "load_worker.py")


@pytest.mark.multiprocess
@pytest.mark.parametrize("mesh, bad", [({"tp_size": 2}, "pickle"), ({"pp_size": 2}, "shapes")],
                         ids=["tp2_pickle", "pp2_shapes"])
def test_one_bad_rank_file_changes_no_rank(tmp_path, mesh, bad):
    """Only rank 1's optimizer file is bad (its manifest entry rewritten to match): rank 1 refuses
    it while reading, rank 0 read its own without error, and both raise before either changes
    anything; then a good load and a step run on both, equal to the step taken from that state
    before."""
    root = tmp_path / "ckpts"
    os.makedirs(root)
    results, codes, logs, _ = launch(2, {"mesh": mesh, "bad": bad, "root": str(root)}, str(tmp_path / "run"),
                                     timeout=300.0, script=WORKER)
    assert codes == [0, 0], "\n".join(log[-3000:] for log in logs)
    # (PP2: rank 0's stage has 9 parameters, rank 1's 10: the count differs before any shape)
    words = ("rank00001.pt' holds a type a checkpoint never contains" if bad == "pickle"
             else "rank00001.pt': optimizer 0 has 9 parameters, this model's has 10")
    for rank, res in enumerate(results):
        assert "crashed" not in res, res["crashed"]
        err = res["bad_load"]
        assert err != "ok" and words in err["error"], (rank, err)
        assert rank == 1 or "rank 1" in err["error"], (rank, err)
        assert res["differences"] == [], (rank, res["differences"])
        assert not res["payload_ran"]
        assert res["good_load"] == {"consumed_train_samples": 8, "cur_step": 2}
        assert res["good_loss"] == res["third_loss"], (rank, res)
