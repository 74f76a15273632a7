"""The teacher's side of GKD: ``forward_only(return_topk=k)`` returns ``topk_logps`` /
``topk_indices`` [B, S, k], the top k of the log-softmax at the call's temperature, aligned as
``logps`` (position t: the distribution of token t; 0 / 0 at t = 0 and where the label is -100).

Against transformers (float64, same weights): fused LM head (vocabulary chunk by chunk, running
top-k and online log-sum-exp) and unfused (vocab-parallel logits), temperatures 1 and 2, plain and
packed rows, the fused path in small vocabulary chunks; TP2, TP2+SP, CP2 and PP2 on two gloo ranks
(tests/megatron_workers/topk_worker.py); a teacher -> student round trip (the teacher's
return_topk fed into the student's GKD forward_backward) against the formula; bad k refused.
"""
import os

import pytest
import torch

pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")

from conftest import megatron_one_rank  # noqa: E402
from tests.megatron_workers.protocol import ROOT, launch  # noqa: E402
from tests.megatron.test_gkd import B, LAYOUTS, S, _rel, generalized_jsd, student_logits  # noqa: E402

K = 8
TOL = 1e-5


@pytest.fixture(scope="module")
def one_rank():
    with megatron_one_rank() as tm:
        yield tm


def _hf(cfg, seed, path):
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(**cfg)).float()
    # a sharper head than the near-uniform random init: distinct top-k values
    with torch.no_grad():
        hf.lm_head.weight.mul_(5.0)
    hf.save_pretrained(path)
    return hf.double()


@pytest.fixture(scope="module")
def setup(one_rank, tmp_path_factory):
    from twinkle_megatron.job.configs import tiny_qwen3_config
    cfg = tiny_qwen3_config(num_layers=2)
    cfg["tie_word_embeddings"] = False
    root = tmp_path_factory.mktemp("topk")
    path, tpath = str(root / "student"), str(root / "teacher")
    hf, thf = _hf(cfg, 0, path), _hf(cfg, 7, tpath)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 259, (B, S), generator=g)
    labels = ids.clone()
    for b, p in enumerate([3, 5, 2]):
        labels[b, :p] = -100
    labels[2, 10:] = -100
    p_ids, p_labels, p_pos = [], [], []
    for n1, n2 in [(7, 5), (6, 6), (8, 4)]:
        row = torch.randint(0, 259, (n1 + n2,), generator=g)
        lab = row.clone()
        lab[0] = lab[n1] = -100
        lab[n1 + 2] = -100
        p_ids.append(row), p_labels.append(lab), p_pos.append(torch.cat([torch.arange(n1), torch.arange(n2)]))
    teachers = {f: one_rank.MegatronModel(tpath, mixed_precision="fp32", fused_linear_ce=f) for f in (False, True)}
    torch.save({"ids": ids, "labels": labels}, str(root / "data.pt"))
    return {"hf": hf, "thf": thf, "vocab": cfg["vocab_size"], "ids": ids, "labels": labels, "root": root,
            "path": path, "tpath": tpath, "teachers": teachers,
            "packed": (torch.stack(p_ids), torch.stack(p_labels), torch.stack(p_pos))}


def reference_topk(hf, ids, labels, temperature, position_ids=None):
    """transformers' (float64) top-k of the log-softmax at ``temperature``, the facade's alignment,
    0 / 0 where there is no loss; also the full log-softmax and the loss mask."""
    with torch.no_grad():
        z = student_logits(hf, ids, position_ids)
    lsm = torch.log_softmax(torch.nan_to_num(z) / temperature, -1)
    vals, idx = lsm.topk(K + 1, -1)
    mask = labels != -100
    mask[:, 0] = False
    return vals, idx, lsm, mask


def check_topk(got_lp, got_ids, hf, ids, labels, temperature, position_ids=None):
    """Max abs error of the values; the ids equal transformers' where the values are not tied
    (within 1e-5 of a neighbour); log-softmax at the returned ids equals the returned values."""
    vals, idx, lsm, mask = reference_topk(hf, ids, labels, temperature, position_ids)
    assert got_lp.dtype == torch.float32 and got_ids.dtype == torch.int64
    assert tuple(got_lp.shape) == tuple(got_ids.shape) == (*ids.shape, K)
    assert (got_lp[~mask] == 0).all() and (got_ids[~mask] == 0).all()
    err = float((got_lp.double() - vals[..., :K])[mask].abs().max())
    at = float((lsm.gather(-1, got_ids) - got_lp.double())[mask].abs().max())
    gap = vals[..., :-1] - vals[..., 1:]                    # [B, S, K]
    untied = torch.ones_like(vals[..., :K], dtype=torch.bool)
    untied &= gap > TOL
    untied[..., 1:] &= gap[..., :K - 1] > TOL
    same = (got_ids == idx[..., :K]) | ~untied
    assert (got_lp[mask][:, 1:] <= got_lp[mask][:, :-1]).all(), "not sorted descending"
    assert bool(same[mask].all()), "ids differ where the values are not tied"
    assert err <= TOL and at <= TOL, (err, at)
    return err, float(untied[mask].float().mean())


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_return_topk_equals_transformers(setup, fused, temperature):
    model = setup["teachers"][fused]
    out = model.forward_only(inputs={"input_ids": setup["ids"], "labels": setup["labels"]}, return_topk=K,
                             temperature=temperature)
    err, untied = check_topk(out["topk_logps"], out["topk_indices"], setup["thf"], setup["ids"], setup["labels"],
                             temperature)
    # the log-probs returned alongside agree with the top-k where the label is the top-1 id
    assert torch.equal(out["logps"] == 0, out["topk_logps"][..., 0] == 0)
    ids, labels, pos = setup["packed"]
    out = model.forward_only(inputs={"input_ids": ids, "labels": labels, "position_ids": pos}, return_topk=K,
                             temperature=temperature, micro_batch_size=1)
    perr, _ = check_topk(out["topk_logps"], out["topk_indices"], setup["thf"], ids, labels, temperature, pos)
    print(f"[return_topk {'fused' if fused else 'unfused'} T={temperature}: max abs err {err:.1e} "
          f"(packed rows {perr:.1e}), ids compared at {untied:.0%} of the entries]")


def test_fused_in_small_vocabulary_chunks(setup, monkeypatch):
    """Vocabulary chunks of 5 rows (fewer than k: the running top-k pads) equal transformers."""
    from twinkle_megatron.layers import lm_head
    calls = []
    monkeypatch.setattr(lm_head, "topk_vocab_chunk", lambda n: calls.append(n) or 5)
    out = setup["teachers"][True].forward_only(inputs={"input_ids": setup["ids"], "labels": setup["labels"]},
                                               return_topk=K, temperature=2.0)
    assert calls == [B * S]
    check_topk(out["topk_logps"], out["topk_indices"], setup["thf"], setup["ids"], setup["labels"], 2.0)


def test_bad_return_topk_is_refused(setup):
    model = setup["teachers"][False]
    inputs = {"input_ids": setup["ids"], "labels": setup["labels"]}
    for bad in (0, -1, setup["vocab"] + 1, 2.0, True, "8"):
        with pytest.raises(ValueError, match="return_topk"):
            model.forward_only(inputs=inputs, return_topk=bad)
    import numpy as np
    assert model.forward_only(inputs=inputs, return_topk=np.int64(3))["topk_indices"].shape == (B, S, 3)
    with pytest.raises(ValueError, match="return_topk"):
        model.forward_only(inputs=inputs, return_topk=np.int64(0))
    out = model.forward_only(inputs=inputs, return_topk=setup["vocab"])
    assert out["topk_indices"].shape == (B, S, setup["vocab"])
    out = model.forward_only(inputs=inputs)
    assert "topk_logps" not in out and "topk_indices" not in out


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_teacher_to_student_round_trip(setup, one_rank, fused):
    """A MegatronModel teacher's return_topk fed into a student's GKD forward_backward: loss and
    grad norm equal the formula with transformers' teacher top-k and student (float64)."""
    import math
    beta, temperature = 0.5, 2.0
    inputs = {"input_ids": setup["ids"], "labels": setup["labels"]}
    top = setup["teachers"][fused].forward_only(inputs=inputs, return_topk=K)
    student = one_rank.MegatronModel(setup["path"], mixed_precision="fp32", fused_linear_ce=fused)
    student.set_optimizer("AdamW", lr=1e-3)
    student.set_loss("gkd", beta=beta, temperature=temperature)
    out = student.forward_backward(inputs=inputs, teacher_topk_logps=top["topk_logps"],
                                   teacher_topk_indices=top["topk_indices"])
    norm = student.clip_grad_norm(0)
    vals, idx, _, mask = reference_topk(setup["thf"], setup["ids"], setup["labels"], 1.0)
    hf = setup["hf"]
    hf.zero_grad()
    z = student_logits(hf, setup["ids"])
    loss = generalized_jsd(z, vals[..., :K], idx[..., :K], setup["labels"], beta, temperature)
    loss.backward()
    ref_norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in hf.parameters() if p.grad is not None))
    hf.zero_grad()
    print(f"[teacher -> student {'fused' if fused else 'unfused'}: loss {float(loss):.6f} rel err "
          f"{_rel(out['loss'], float(loss)):.1e}, norm rel err {_rel(norm, ref_norm):.1e}]")
    assert float(loss) > 1e-2
    assert _rel(out["loss"], float(loss)) <= TOL and _rel(norm, ref_norm) <= TOL


# LAYOUTS: the same two-rank layouts as the student's side (tests/megatron/test_gkd.py)
TEMPS = [1.0, 2.0]


@pytest.mark.multiprocess
def test_two_rank_layouts_equal_one_process(setup):
    """TP2 (each rank's top k of its vocabulary shard, merged over the group), TP2+SP, CP2 (rows
    reassembled as logps are) and PP2 (broadcast from the last stage): both ranks' top-k equal
    the one-process result and transformers'."""
    root = setup["root"]
    spec = {"data": str(root / "data.pt"), "model_dir": setup["tpath"], "runs": LAYOUTS, "temperatures": TEMPS,
            "k": K}
    res, rcs, logs, elapsed = launch(2, spec, str(root / "two"), timeout=400,
                                     script=os.path.join(ROOT, "tests", "megatron_workers", "topk_worker.py"))
    assert rcs == [0, 0] and all(r is not None for r in res), "\n".join(l[-3000:] for l in logs)
    inputs = {"input_ids": setup["ids"], "labels": setup["labels"]}
    worst = {}
    for temperature in TEMPS:
        one = setup["teachers"][True].forward_only(inputs=inputs, return_topk=K, temperature=temperature)
        for run in LAYOUTS:
            for rank in (0, 1):
                rec = res[rank][run["name"]]
                assert rec["ok"], rec.get("traceback")
                got = rec[str(temperature)]
                assert got["dtype"] == ["torch.float32", "torch.int64"]
                lp, ids = torch.tensor(got["logps"]), torch.tensor(got["ids"])
                err, _ = check_topk(lp, ids, setup["thf"], setup["ids"], setup["labels"], temperature)
                d = float((lp - one["topk_logps"]).abs().max())
                worst[run["name"]] = max(worst.get(run["name"], 0.0), err)
                assert d <= TOL, (run["name"], rank, d)
    print(f"[2 ranks: {elapsed:.1f}s; max abs err vs transformers: " +
          ", ".join(f"{k} {v:.1e}" for k, v in worst.items()) + "]")
