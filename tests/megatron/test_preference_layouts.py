"""Upstream Twinkle's preference losses and SAPO (issue 47) under every layout, on both LM heads,
and in mixed-adapter batches.

Every case (DPO's ``loss_type`` sigmoid with label smoothing, hinge, ipo, kto_pair;
``reference_free``; ``sft_weight``; DPO at another beta; SimPO, CPO, ORPO, SAPO; and the rest of
the GRPO family: GSPO, CISPO, BNPO, Dr. GRPO) runs on one rank
and under TP2, PP2, CP2 and DP2, each with the fused LM head (``use_twinkle_kernels=True``: the loss's
log-probs from twinkle_kernels' fused linear cross-entropy, no logits) and without it
(megatron's ``output_layer``). Loss and pre-clip grad norm must equal the float64 formula
(``reference_loss`` of tests/megatron/test_megatron_losses.py, written from upstream's and TRL's
definitions) on the log-softmax of the transformers model of the same weights, with its grad norm.

Mixed-adapter batches: two LoRA adapters on one base, eight pairs of losses (a different loss on
each adapter, and DPO on both at different betas), one ``forward_backward(adapter_names=...)``
call; each adapter's loss and grad norm must equal its rows sent alone through the same weights,
and the alone loss must equal the float64 formula on the log-probs that call returns. On one rank
with either head, under TP2, PP2 and CP2 with the fused head, and under DP2 with either head
(each rank its half of the rows; the alone loss against the formula on both ranks' log-probs).
"""
import math
import os

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

from tests.megatron.test_megatron_losses import CASES as LOSS_CASES, reference_loss, tiny_qwen3_folder  # noqa: E402
from tests.megatron_workers.protocol import ROOT, launch  # noqa: E402

VOCAB, SEQ, B = 128, 16, 4
WORKER = os.path.join(ROOT, "tests", "megatron_workers", "preference_worker.py")
CASES = {cid: LOSS_CASES[cid] for cid in ("dpo", "dpo_hinge", "dpo_ipo", "dpo_kto_pair", "dpo_reference_free",
                                          "dpo_sft", "simpo", "cpo", "orpo", "sapo", "gspo", "cispo", "bnpo",
                                          "dr_grpo")}
CASES["dpo_beta"] = ("dpo", {"beta": 0.2}, ["ref_logps"], {})
# (a's loss, b's loss) in one mixed call; every case on some adapter, and one loss on both
MIXED = [("dpo_sft", "simpo"), ("dpo_ipo", "orpo"), ("dpo_kto_pair", "sapo"), ("dpo_hinge", "dpo_reference_free"),
         ("cpo", "dpo"), ("dpo", "dpo_beta"), ("gspo", "cispo"), ("bnpo", "dr_grpo")]
ONE = [{"name": "single", "mesh": {"world_size": 1}, "kernels": False, "mixed": True},
       {"name": "single_fused", "mesh": {"world_size": 1}, "kernels": True, "mixed": True}]
TWO = [{"name": "tp2", "mesh": {"tp_size": 2}, "kernels": False},
       {"name": "tp2_fused", "mesh": {"tp_size": 2}, "kernels": True, "mixed": True},
       {"name": "pp2", "mesh": {"pp_size": 2}, "kernels": False, "mbs": 2},
       {"name": "pp2_fused", "mesh": {"pp_size": 2}, "kernels": True, "mbs": 2, "mixed": True, "mixed_mbs": 4},
       {"name": "cp2", "mesh": {"cp_size": 2}, "kernels": False},
       {"name": "cp2_fused", "mesh": {"cp_size": 2}, "kernels": True, "mixed": True},
       # each DP rank its share of the rows (tests/megatron_workers/preference_worker.py)
       {"name": "dp2", "mesh": {"dp_size": 2}, "kernels": False, "mixed": True},
       {"name": "dp2_fused", "mesh": {"dp_size": 2}, "kernels": True, "mixed": True}]


def _token_logps(logits, labels):
    """[B, S] float64 log-prob of each label (0 at t = 0 and where labels == -100)."""
    lsm = torch.log_softmax(logits[:, :-1].double(), -1)
    mask = labels[:, 1:] != -100
    lp = lsm.gather(-1, labels[:, 1:].clamp(min=0)[..., None])[..., 0] * mask
    return torch.cat([lp.new_zeros(lp.shape[0], 1), lp], 1)


def _labels(ids, prompts, short=None):
    labels = ids.clone()
    for b, p in enumerate(prompts):
        labels[b, :p] = -100
    if short is not None:
        labels[short[0], short[1]:] = -100
    return labels


def _mask(labels):
    m = labels != -100
    m[:, 0] = False
    return m


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("preference")
    hf, model_dir = tiny_qwen3_folder(root)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (B, SEQ), generator=g)
    labels = _labels(ids, [3, 5, 2, 6], short=(3, 13))
    with torch.no_grad():
        lp = _token_logps(hf(input_ids=ids).logits, labels)
    mask = _mask(labels)
    m_ids = torch.randint(0, VOCAB, (2 * B, SEQ), generator=g)
    m_labels = _labels(m_ids, [3, 5, 2, 6, 4, 2, 5, 3], short=(6, 12))
    m_mask = _mask(m_labels)
    data = {"ids": ids, "labels": labels, "loss_mask": mask,
            "advantages": torch.randn(B, generator=g),
            "old_logps": ((lp + 0.3 * torch.randn(B, SEQ, generator=g)) * mask).float(),
            "ref_logps": ((lp + 0.2 * torch.randn(B, SEQ, generator=g)) * mask).float(),
            # the adapters' policies are near the base's, whose log-probs are about -log V here
            "mixed_ids": m_ids, "mixed_labels": m_labels, "mixed_loss_mask": m_mask,
            "mixed_advantages": torch.randn(2 * B, generator=g),
            "mixed_old_logps": ((-4.85 + 0.3 * torch.randn(2 * B, SEQ, generator=g)) * m_mask).float(),
            "mixed_ref_logps": ((-4.85 + 0.2 * torch.randn(2 * B, SEQ, generator=g)) * m_mask).float()}
    torch.save(data, str(root / "data.pt"))
    return {"hf": hf, "model_dir": model_dir, "data": data, "root": root}


@pytest.fixture(scope="module")
def results(setup):
    root = setup["root"]
    cases = [{"id": cid, "loss": name, "kwargs": kw, "args": args} for cid, (name, kw, args, _) in CASES.items()]
    out = {}
    for n, runs in ((1, ONE), (2, TWO)):
        spec = {"data": str(root / "data.pt"), "model_dir": setup["model_dir"], "cases": cases,
                "mixed": MIXED, "runs": runs}
        res, rcs, logs, elapsed = launch(n, spec, str(root / f"run{n}"), timeout=900, script=WORKER)
        assert rcs == [0] * n and all(r is not None for r in res), "\n".join(l[-3000:] for l in logs)
        print(f"[{n} ranks: {elapsed:.1f}s]")
        for rank, r in enumerate(res):
            for name, rec in r.items():
                out[(name, rank)] = rec
    return out


def _get(results, name, rank):
    rec = results[(name, rank)]
    assert rec["ok"], rec.get("traceback")
    return rec


@pytest.fixture(scope="module")
def references(setup):
    """{case id: (loss, grad norm)} of the transformers model, float64 formulas."""
    hf, d = setup["hf"], setup["data"]
    out = {}
    for cid, (name, kw, _, _) in CASES.items():
        hf.zero_grad()
        lp = _token_logps(hf(input_ids=d["ids"]).logits, d["labels"])
        loss = reference_loss(name, kw, lp, torch.zeros_like(lp), d["loss_mask"], d)   # no entropy bonus here
        loss.backward()
        norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in hf.parameters() if p.grad is not None))
        out[cid] = (float(loss.detach()), norm)
    return out


LAYOUTS = [(r["name"], 0) for r in ONE] + [(r["name"], k) for r in TWO for k in (0, 1)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name, rank", LAYOUTS)
@pytest.mark.parametrize("cid", list(CASES))
def test_loss_and_grad_norm_equal_the_formula(results, references, name, rank, cid):
    rec = _get(results, name, rank)
    assert rec["fused_linear_ce"] == name.endswith("_fused")
    loss, norm = references[cid]
    got = rec[cid]
    assert abs(got["loss"] - loss) <= 1e-5 * max(1.0, abs(loss)), (got["loss"], loss)
    assert abs(got["norm"] - norm) <= 1e-4 * max(1.0, norm), (got["norm"], norm)
    assert norm > 1e-3


def _alone_reference(setup, case, adapter, logps):
    """The float64 formula of ``case`` on ``adapter``'s rows of the mixed batch (in order) at ``logps``."""
    from tests.megatron_workers.preference_worker import NAMES
    d = setup["data"]
    rows = [i for i, m in enumerate(NAMES) if m == adapter]
    rd = {k: d["mixed_" + k][rows] for k in ("advantages", "old_logps", "ref_logps")}
    mask = d["mixed_loss_mask"][rows]
    lp = torch.tensor(logps, dtype=torch.float64) * mask
    name, kw, _, _ = CASES[case]
    return float(reference_loss(name, kw, lp, torch.zeros_like(lp), mask, rd))


MIXED_LAYOUTS = [(r["name"], 0) for r in ONE] + [(r["name"], k) for r in TWO if r.get("mixed") for k in (0, 1)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name, rank", MIXED_LAYOUTS)
@pytest.mark.parametrize("pair", MIXED, ids=["+".join(p) for p in MIXED])
def test_mixed_adapter_batch_equals_each_adapter_alone(setup, results, name, rank, pair):
    rec = _get(results, name, rank)["mixed"]["+".join(pair)]
    for adapter, case in zip(("a", "b"), pair):
        got = rec[adapter]
        assert abs(got["loss"] - got["alone_loss"]) <= 1e-5 * max(1.0, abs(got["alone_loss"])), (adapter, got)
        assert abs(got["norm"] - got["alone_norm"]) <= 1e-5 * got["alone_norm"] and got["alone_norm"] > 1e-4, \
            (adapter, got["norm"], got["alone_norm"])
        logps = got["alone_logps"]
        if name.startswith("dp2"):      # each rank returns its own rows' log-probs; the loss is over both
            logps = [row for k in (0, 1) for row in _get(results, name, k)["mixed"]["+".join(pair)][adapter]
                     ["alone_logps"]]
        want = _alone_reference(setup, case, adapter, logps)
        assert abs(got["alone_loss"] - want) <= 1e-5 * max(1.0, abs(want)), (adapter, got["alone_loss"], want)
