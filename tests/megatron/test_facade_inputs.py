"""Every input of a facade call is checked before the schedule runs, and a refused call leaves
nothing behind (the state snapshot of tests/megatron/test_facade_transactions.py, then one good step equal
to a twin model's that never saw the bad call).

Rows: unknown ``inputs`` keys (a close misspelling suggested), packing keys pointed at
``position_ids``, ``position_ids`` of another shape in ``logits()`` / ``forward_only()``, GKD's
top-k arguments (dtype, range, duplicates, log-probs > 0, all -inf), GRPO / DPO arguments that
are not finite at a loss position. Under CP2 / TP2 (gloo, tests/megatron_workers/
transaction_worker.py): arguments that differ between the ranks of a replica raise
``InputMismatchError`` on every rank, and a call failing in its second micro-batch leaves no
trace (the next step equals a twin's to 1e-6).
"""
import os
import re

import pytest
import torch

pytest.importorskip("megatron.core")

from test_facade_transactions import (B, S, VOCAB, assert_identical, assert_twins, batch, loss_mask,  # noqa: E402
                                      make, one_rank, snapshot)  # noqa: F401 (one_rank: the fixture)
from tests.megatron_workers.protocol import ROOT, launch  # noqa: E402

K = 4


def refused(model, error, match, call=None, **kw):
    """``call`` (default: forward_backward(inputs=batch(), **kw)) raises ``error`` matching
    ``match`` and changes nothing."""
    before = snapshot(model)
    with pytest.raises(error, match=match):
        if call is None:
            model.forward_backward(inputs=batch(), **kw)
        else:
            call()
    assert_identical(snapshot(model), before)


# ---- inputs keys --------------------------------------------------------------------------------

def test_unknown_and_packing_keys_are_refused(one_rank):
    model, twin = make(one_rank), make(one_rank)
    b = batch()
    pos = torch.arange(S).expand(B, S)
    cu = torch.tensor([0, S, 2 * S], dtype=torch.int32)
    refused(model, ValueError, r"unknown key 'position_id' \(did you mean 'position_ids'\?\); accepted keys: "
            r"\['input_ids', 'labels', 'position_ids', 'attention_mask'\]",
            call=lambda: model.forward_backward(inputs={**b, "position_id": pos}))
    refused(model, ValueError, r"unknown key 'label' \(did you mean 'labels'\?\)",
            call=lambda: model.forward_only(inputs={**b, "label": b["labels"]}))
    refused(model, ValueError, r"unknown key 'advantages'.*keywords",
            call=lambda: model.forward_backward(inputs={**b, "advantages": torch.ones(B)}))
    refused(model, ValueError, r"inputs\['cu_seqlens'\]: packed rows are given by position_ids restarting at 0",
            call=lambda: model.forward_backward(inputs={**b, "cu_seqlens": cu}))
    from twinkle_megatron.packing import packed_seq_params
    refused(model, ValueError, r"inputs\['packed_seq_params'\]: .*Pass position_ids instead",
            call=lambda: model.forward_backward(inputs={**b, "packed_seq_params": packed_seq_params(cu, "cpu")}))
    samples = [{"input_ids": b["input_ids"][i], "labels": b["labels"][i]} for i in range(B)]
    samples[2] = dict(samples[2], position_id=pos[0])
    refused(model, ValueError, r"inputs\[2\] has an unknown key 'position_id' \(did you mean 'position_ids'\?\)",
            call=lambda: model.forward_backward(inputs=samples))
    samples[2] = {"input_ids": b["input_ids"][2]}
    refused(model, ValueError, r"inputs\[2\] has keys \['input_ids'\], inputs\[0\] has \['input_ids', 'labels'\]",
            call=lambda: model.forward_backward(inputs=samples))
    assert_twins(model, twin, batch())


def test_position_ids_are_checked_against_input_ids(one_rank):
    """logits(): a shorter position_ids gave wrong logits (0.26 off), a longer one crashed in
    megatron's rope_utils; forward_only the same through its inputs."""
    model, twin = make(one_rank), make(one_rank)
    b = batch()
    ids = b["input_ids"]
    for pos in (torch.arange(S - 1).expand(B, -1), torch.arange(S + 1).expand(B, -1), torch.arange(S)):
        shape = re.escape(str(tuple(pos.shape)))
        refused(model, ValueError, rf"position_ids has shape {shape}, input_ids has \({B}, {S}\)",
                call=lambda: model.logits(ids, pos))
        refused(model, ValueError, rf"inputs\['position_ids'\] has shape {shape}, input_ids has",
                call=lambda: model.forward_only(inputs={**b, "position_ids": pos}))
    good = torch.arange(S).expand(B, -1)
    assert_identical(model.logits(ids, good), model.logits(ids))
    assert_twins(model, twin, batch())


# ---- GKD's top-k teacher ------------------------------------------------------------------------

def _teacher(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(B, S, VOCAB, generator=g).argsort(-1)[..., :K]
    logps = torch.log_softmax(torch.randn(B, S, K, generator=g), -1) - 0.5    # a top-k: mass < 1
    return logps, ids


def test_gkd_topk_arguments_are_checked(one_rank):
    model, twin = make(one_rank, "gkd"), make(one_rank, "gkd")
    lp, ix = _teacher()
    mask = loss_mask(batch())
    i, j = (int(v) for v in mask.nonzero()[3])       # a loss position
    dup = ix.clone()
    dup[i, j, 1] = dup[i, j, 0]
    pos = lp.clone()
    pos[i, j, 2] = 0.25
    dead = lp.clone()
    dead[i, j] = float("-inf")
    cases = [
        ({"teacher_topk_logps": lp, "teacher_topk_indices": ix.bool()}, "teacher_topk_indices must hold integer "
         "vocabulary ids, got dtype torch.bool"),
        ({"teacher_topk_logps": lp, "teacher_topk_indices": dup},
         rf"teacher_topk_indices: the k ids of one position must differ, got .* at teacher_topk_indices\[{i}, {j}\]"),
        ({"teacher_topk_logps": pos, "teacher_topk_indices": ix},
         rf"teacher_topk_logps must hold log-probabilities \(<= 0\), got teacher_topk_logps\[{i}, {j}, 2\] = 0.25"),
        ({"teacher_topk_logps": lp.round().long(), "teacher_topk_indices": ix},
         "teacher_topk_logps must be a float tensor, got dtype torch.int64"),
        ({"teacher_topk_logps": dead, "teacher_topk_indices": ix},
         rf"teacher_topk_logps must not be -inf for all k ids at a loss position.*\[{i}, {j}\]"),
        ({"teacher_topk_logps": lp * 0.01, "teacher_topk_indices": ix},
         rf"teacher_topk_logps: the k probabilities of one position must sum to <= 1, got .* at "
         rf"teacher_topk_logps\[0, 3\]"),
        ({"teacher_topk_logps": lp, "teacher_topk_indices": ix + model.shape.vocab_size},
         rf"vocabulary ids in \[0, {model.shape.vocab_size}\)"),
    ]
    for kw, match in cases:
        refused(model, ValueError, match, **kw)
        refused(model, ValueError, match, call=lambda: model.forward_only(inputs=batch(), **kw))
    # off the loss positions nothing is read: duplicates, -inf, > 0 there are accepted
    off = (~mask).nonzero()[0].tolist()
    lp_off, ix_off = lp.clone(), ix.clone()
    lp_off[off[0], off[1]] = float("-inf")
    ix_off[off[0], off[1]] = 3
    for m in (model, twin):
        out = m.forward_backward(inputs=batch(), teacher_topk_logps=lp_off, teacher_topk_indices=ix_off)
        assert torch.isfinite(torch.tensor(out["loss"]))
        m.zero_grad()
    assert_twins(model, twin, batch(), teacher_topk_logps=lp, teacher_topk_indices=ix)


# ---- GRPO / DPO ---------------------------------------------------------------------------------

def test_grpo_and_dpo_arguments_must_be_finite_at_loss_positions(one_rank):
    model, twin = make(one_rank, "grpo", beta=0.1), make(one_rank, "grpo", beta=0.1)
    b = batch()
    mask = loss_mask(b)
    i, j = (int(v) for v in mask.nonzero()[5])
    g = torch.Generator().manual_seed(1)
    adv = torch.randn(B, generator=g)
    old = -torch.rand(B, S, generator=g)
    ref = -torch.rand(B, S, generator=g)
    ok = {"advantages": adv, "old_logps": old, "ref_logps": ref}
    for name, value in (("advantages", float("nan")), ("old_logps", float("nan")), ("ref_logps", float("inf")),
                        ("old_logps", float("-inf"))):
        bad = dict(ok)
        bad[name] = (ok[name][:, None].expand(B, S) if name == "advantages" else ok[name]).clone()
        bad[name][i, j] = value
        refused(model, ValueError, rf"{name} must be finite at the loss positions; {name}\[{i}, {j}\] = {value}",
                **bad)
    refused(model, ValueError, r"advantages must hold real numbers, got dtype torch.bool",
            advantages=adv > 0, old_logps=old, ref_logps=ref)
    # a NaN where no loss is taken is not read (it used to reach the backward as 0 * NaN)
    off = (~mask).nonzero()[0].tolist()
    nan_off = old.clone()
    nan_off[off[0], off[1]] = float("nan")
    for m in (model, twin):
        got = m.forward_backward(inputs=b, advantages=adv, old_logps=nan_off, ref_logps=ref)
        m.zero_grad()
        want = m.forward_backward(inputs=b, advantages=adv, old_logps=old, ref_logps=ref)
        m.zero_grad()
        assert got["loss"] == want["loss"]
    assert_twins(model, twin, b, **ok)

    dpo, dpo_twin = make(one_rank, "dpo"), make(one_rank, "dpo")
    bad = ref.clone()
    bad[i, j] = float("nan")
    refused(dpo, ValueError, rf"ref_logps must be finite at the loss positions; ref_logps\[{i}, {j}\] = nan",
            ref_logps=bad)
    assert_twins(dpo, dpo_twin, b, ref_logps=ref)


# ---- several ranks (gloo) -----------------------------------------------------------------------

WORKER = os.path.join(ROOT, "tests", "megatron_workers", "transaction_worker.py")


@pytest.mark.parametrize("mesh", [{"cp_size": 2}, {"tp_size": 2, "sequence_parallel": True}, {"pp_size": 2}],
                         ids=["cp2", "tp2_sp", "pp2"])
def test_two_ranks_agree_and_roll_back(tmp_path, mesh):
    """On 2 gloo ranks of one replica: advantages / old_logps / GKD teacher / routed_experts that
    differ between the ranks raise InputMismatchError on both, naming the argument; a call whose
    user metric raises in micro-batch 2 (under PP2 on the last stage only: the first stage learns
    of it after the schedule, not at the collective timeout) leaves no trace on either rank and
    the next step equals a twin's (1e-6)."""
    results, codes, logs, _ = launch(2, {"mesh": mesh}, str(tmp_path), timeout=400.0, script=WORKER)
    assert codes == [0, 0], "\n".join(log[-3000:] for log in logs)
    for rank, res in enumerate(results):
        assert "crashed" not in res, res["crashed"]
        for case in ("advantages", "old_logps", "teacher_topk_logps", "routed_experts"):
            got = res[case]
            assert got["type"] == "InputMismatchError", (rank, case, got)
            assert f"differ in {case}" in got["error"], (rank, case, got)
        assert res["same_arguments"] == "ok", res
        # a bad argument on one rank: refused on both, before any work
        nan = res["nan_on_rank1"]
        assert nan["type"] == "ValueError" and "advantages must be finite at the loss positions" in nan["error"], nan
        assert rank == 1 or "rank 1 refused its inputs" in nan["error"], nan
        assert res["failed_call"]["type"] == "RuntimeError" and "micro-batch 2" in res["failed_call"]["error"]
        assert res["state_after_failure"] == "identical", res
        assert res["twin_param_diff"] <= 1e-6, res
        assert res["twin_loss_diff"] <= 1e-6, res


def test_one_data_parallel_rank_failing_rolls_back_both(tmp_path):
    """DP2: the user metric raises in micro-batch 2 on rank 1 only. Rank 0, which computed its
    loss, learns of it after the schedule and raises too, naming rank 1 (not at the collective
    timeout); both roll back, and the next step equals a twin's (1e-6)."""
    spec = {"mesh": {"dp_size": 2}, "rollback_only": True, "fail_rank": 1}
    results, codes, logs, _ = launch(2, spec, str(tmp_path), timeout=300.0, script=WORKER)
    assert codes == [0, 0], "\n".join(log[-3000:] for log in logs)
    for rank, res in enumerate(results):
        assert "crashed" not in res, res["crashed"]
        err = res["failed_call"]
        assert err["type"] == "RuntimeError" and "metric failed on micro-batch 2" in err["error"], err
        assert rank == 1 or "rank 1 refused this call (its loss function raised" in err["error"], err
        assert res["state_after_failure"] == "identical", res
        assert res["twin_param_diff"] <= 1e-6 and res["twin_loss_diff"] <= 1e-6, res
