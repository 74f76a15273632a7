"""``MegatronModel(fused_linear_ce=True)``: the loss from the final hidden states and the output
weight shard (twinkle_kernels' fused linear cross-entropy) against megatron's ``output_layer`` +
the vocab-parallel log-softmax, at the same checkpoint, under the parallel layouts (TP2, TP2+SP, PP2, interleaved PP2 x VPP2, CP2; tied embeddings; bf16).

Per layout (tests/megatron_workers/fused_ce_worker.py) both models give forward_only logps and
entropy (temperature 0.7; packed rows), a GRPO loss with an entropy bonus and its grad norm (and
every other loss of twinkle_megatron.training.losses under one process and TP2+SP), and
three cross-entropy training steps (loss, pre-clip grad norm); the fused model never calls
``output_layer``. The unfused path itself is checked against transformers in
tests/megatron/test_megatron_losses.py.
"""
import os

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

from tests.megatron_workers.protocol import ROOT, launch  # noqa: E402

VOCAB, SEQ, B = 128, 16, 4
WORKER = os.path.join(ROOT, "tests", "megatron_workers", "fused_ce_worker.py")
PACKED = [(9, 7), (10, 6), (8, 8), (12, 4)]
TOL = 1e-5

ONE = [{"name": "single", "mesh": {"world_size": 1}, "twinkle_default": True, "all_losses": True, "logits": True},
       {"name": "tied", "mesh": {"world_size": 1}, "model": "tied", "packed": False},
       {"name": "bf16", "mesh": {"world_size": 1}, "precision": "bf16", "packed": False}]
TWO = [{"name": "tp2", "mesh": {"tp_size": 2}},
       {"name": "tp2_sp", "mesh": {"tp_size": 2, "sequence_parallel": True}, "all_losses": True},
       {"name": "tp2_tied", "mesh": {"tp_size": 2}, "model": "tied", "packed": False},
       {"name": "pp2", "mesh": {"pp_size": 2}, "mbs": 2, "packed": False},
       {"name": "pp2_tied", "mesh": {"pp_size": 2}, "model": "tied", "mbs": 2, "packed": False},
       {"name": "pp2_vpp2_tied", "mesh": {"pp_size": 2, "vpp_size": 2}, "model": "deep_tied", "mbs": 1,
        "packed": False},
       {"name": "cp2", "mesh": {"cp_size": 2}, "packed": False}]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from transformers import AutoModelForCausalLM, Qwen3Config
    root = tmp_path_factory.mktemp("fused_ce")
    dirs = {}
    for name, tie, layers in (("untied", False, 2), ("tied", True, 2), ("deep_tied", True, 4)):
        cfg = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                          max_position_embeddings=64, intermediate_size=128, num_hidden_layers=layers,
                          head_dim=16, tie_word_embeddings=tie)
        torch.manual_seed(0)
        dirs[name] = str(root / name)
        AutoModelForCausalLM.from_config(cfg).float().save_pretrained(dirs[name])
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (B, SEQ), generator=g)
    labels = ids.clone()
    for b, p in enumerate([3, 5, 2, 6]):
        labels[b, :p] = -100
    labels[3, 13:] = -100
    mask = labels != -100
    mask[:, 0] = False
    p_ids, p_labels, p_pos = [], [], []
    for n1, n2 in PACKED:
        row = torch.randint(0, VOCAB, (n1 + n2,), generator=g)
        lab = row.clone()
        lab[n1] = -100
        p_ids.append(row), p_labels.append(lab)
        p_pos.append(torch.cat([torch.arange(n1), torch.arange(n2)]))
    data = {"ids": ids, "labels": labels, "advantages": torch.randn(B, generator=g),
            # GRPO's ratios need old logps near the policy's (about -log V here)
            "old_logps": ((-4.85 + 0.3 * torch.randn(B, SEQ, generator=g)) * mask).float(),
            "ref_logps": ((-4.85 + 0.2 * torch.randn(B, SEQ, generator=g)) * mask).float(),
            "packed_input_ids": torch.stack(p_ids), "packed_labels": torch.stack(p_labels),
            "packed_position_ids": torch.stack(p_pos)}
    torch.save(data, str(root / "data.pt"))
    out = {}
    for n, runs in ((1, ONE), (2, TWO)):
        spec = {"data": str(root / "data.pt"), "model_dirs": dirs, "runs": runs}
        res, rcs, logs, elapsed = launch(n, spec, str(root / f"run{n}"), timeout=400, script=WORKER)
        assert rcs == [0] * n and all(r is not None for r in res), "\n".join(l[-3000:] for l in logs)
        print(f"[{n} ranks: {elapsed:.1f}s]")
        for rank, r in enumerate(res):
            for name, rec in r.items():
                out[(name, rank)] = rec
    return out


LAYOUTS = [(r["name"], 0) for r in ONE if "precision" not in r] + [(r["name"], k) for r in TWO for k in (0, 1)]
WITH_PACKED = {r["name"] for r in ONE + TWO if r.get("packed", True)}


def _close(a, b, tol=TOL):
    return abs(a - b) <= tol * max(1.0, abs(b))


def _get(results, name, rank):
    rec = results[(name, rank)]
    assert rec["ok"], rec.get("traceback")
    return rec


@pytest.mark.multiprocess
@pytest.mark.parametrize("name, rank", LAYOUTS)
def test_training_steps_match_the_unfused_loss(results, name, rank):
    rec = _get(results, name, rank)
    ref, got = rec["unfused"], rec["fused"]
    assert got["fused_linear_ce"] and not ref["fused_linear_ce"]
    assert got["output_layer_calls"] == 0 and (ref["output_layer_calls"] > 0 or name.startswith("pp2") and rank == 0)
    if "logits" in ref:
        a, b = torch.tensor(got["logits"]), torch.tensor(ref["logits"])
        assert a.shape == (B, SEQ, VOCAB) and torch.equal(a, b)
    print(name, rank, [a - b for a, b in zip(got["losses"], ref["losses"])],
          [a - b for a, b in zip(got["norms"], ref["norms"])])
    assert all(_close(a, b) for a, b in zip(got["losses"], ref["losses"])), (got["losses"], ref["losses"])
    assert all(_close(a, b) for a, b in zip(got["norms"], ref["norms"])), (got["norms"], ref["norms"])
    assert ref["losses"][2] < ref["losses"][0]   # the steps train
    assert min(ref["norms"]) > 1e-2
    # Cross entropy's logps gradient is one number per loss token: with one TP rank the fused head
    # computes its gradients in the forward and every backward uses them (the losses and norms
    # above are then that path's); the vocab-parallel head (TP2) recomputes. GRPO's is not
    # uniform: its head is never asked to.
    heads = ref["output_layer_calls"] > 0
    tp = {r["name"]: r["mesh"].get("tp_size", 1) for r in ONE + TWO}[name]
    assert got["grpo_forward_grads"] == [] and ref["ce_forward_grads"] == []
    if heads and tp == 1:
        assert got["ce_forward_grads"] and all(got["ce_forward_grads"]), got["ce_forward_grads"]
    else:
        assert got["ce_forward_grads"] == []


@pytest.mark.multiprocess
@pytest.mark.parametrize("name, rank", LAYOUTS)
def test_grpo_step_and_forward_only_match_the_unfused_path(results, name, rank):
    rec = _get(results, name, rank)
    ref, got = rec["unfused"], rec["fused"]
    for k in ("loss", "norm", "kl", "clip_frac"):
        assert _close(got["grpo"][k], ref["grpo"][k]), (k, got["grpo"], ref["grpo"])
    assert 0 < ref["grpo"]["clip_frac"] < 1 and ref["grpo"]["norm"] > 1e-3
    kinds = [k for k in ("fo_plain", "fo_packed") if k in ref]
    assert kinds == (["fo_plain", "fo_packed"] if name in WITH_PACKED else ["fo_plain"])
    for kind in kinds:
        for key in ("logps", "entropy"):
            a, b = torch.tensor(got[kind][key]), torch.tensor(ref[kind][key])
            assert a.shape == (B, SEQ) and float(b.abs().sum()) > 1.0
            err = float((a - b).abs().max())
            assert err <= TOL, (kind, key, err)
        assert _close(got[kind]["loss"], ref[kind]["loss"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("name, rank", [("single", 0), ("tp2_sp", 0), ("tp2_sp", 1)])
@pytest.mark.parametrize("loss", ["dr_grpo", "bnpo", "gspo", "cispo", "dpo"])
def test_every_loss_matches_the_unfused_path(results, name, rank, loss):
    rec = _get(results, name, rank)
    ref, got = rec["unfused"][loss], rec["fused"][loss]
    assert _close(got["loss"], ref["loss"]) and _close(got["norm"], ref["norm"]), (got, ref)
    assert ref["norm"] > 1e-3


@pytest.mark.multiprocess
def test_twinkle_kernels_turn_the_fused_path_on(results):
    rec = _get(results, "single", 0)
    tw, ref = rec["twinkle"], rec["unfused"]
    assert tw["fused_linear_ce"] and tw["output_layer_calls"] == 0
    assert all(_close(a, b) for a, b in zip(tw["losses"], ref["losses"])), (tw["losses"], ref["losses"])


@pytest.mark.multiprocess
def test_bf16_matches_the_unfused_path_within_the_bf16_tolerance(results):
    """bf16 weights: the fused path takes the (exact) bf16 hidden states and keeps its logits in
    fp32, where output_layer rounds them to bf16 first: equal within bf16's tolerance."""
    from twinkle_kernels.testing import tolerance
    atol, rtol = tolerance(torch.bfloat16)
    rec = _get(results, "bf16", 0)
    ref, got = rec["unfused"], rec["fused"]
    assert got["output_layer_calls"] == 0
    pairs = list(zip(got["losses"], ref["losses"])) + list(zip(got["norms"], ref["norms"]))
    pairs += [(got["grpo"]["loss"], ref["grpo"]["loss"]), (got["fo_plain"]["loss"], ref["fo_plain"]["loss"])]
    print("bf16", [a - b for a, b in pairs])
    assert all(abs(a - b) <= atol + rtol * abs(b) for a, b in pairs), pairs
    for key in ("logps", "entropy"):
        a, b = torch.tensor(got["fo_plain"][key]), torch.tensor(ref["fo_plain"][key])
        err = float(((a - b).abs() - rtol * b.abs()).max())
        assert err <= atol, (key, err)
