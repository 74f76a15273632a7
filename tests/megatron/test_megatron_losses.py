"""Pluggable losses and per-token outputs of the Megatron facade, against transformers.

The references here are independent: transformers' logits for the same weights, ``log_softmax``,
and each loss written out in plain torch from its formula (whole global batch at once), with
the grad norm over transformers' parameters. The facade is run (tests/megatron_workers/
losses_worker.py) with one process, then two (TP2, TP2+SP, PP2, CP2, DP2), split into micro-batches,
accumulation calls and DP shares: every layout must give the same loss and grad norm.
"""
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

from tests.megatron_workers.protocol import ROOT, launch  # noqa: E402

VOCAB, SEQ, B = 128, 16, 4
WORKER = os.path.join(ROOT, "tests", "megatron_workers", "losses_worker.py")
GRPO_KW = {"epsilon": 0.2, "epsilon_high": 0.28, "beta": 0.04, "entropy_coef": 0.01}
ARGS = ["advantages", "old_logps", "ref_logps"]
PACKED = [(9, 7), (10, 6), (8, 8), (12, 4)]   # two samples per packed row


# ---- references --------------------------------------------------------------------------

def _token_stats(logits, labels, temperature=1.0):
    """logps, entropy [B, S] aligned with labels (0 at t=0 and where labels == -100)."""
    lsm = torch.log_softmax(logits[:, :-1].double() / temperature, -1)
    mask = labels[:, 1:] != -100
    lp = lsm.gather(-1, labels[:, 1:].clamp(min=0)[..., None])[..., 0] * mask
    ent = -(lsm.exp() * lsm).sum(-1) * mask
    pad = lp.new_zeros(lp.shape[0], 1)
    return torch.cat([pad, lp], 1), torch.cat([pad, ent], 1)


def _k3(lp, ref):
    d = ref - lp
    return d.exp() - d - 1


def _policy_token_loss(lp, old, adv, ref, ent, epsilon, epsilon_high, beta, entropy_coef):
    ratio = torch.exp(lp - old)
    a = adv[:, None]
    loss = -torch.minimum(ratio * a, torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high) * a)
    return loss + beta * _k3(lp, ref) - entropy_coef * ent


def reference_loss(name, kw, lp, ent, mask, d):
    """The loss of the whole global batch, straight from its formula."""
    m = mask.double()
    adv, old, ref = d["advantages"].double(), d["old_logps"].double(), d["ref_logps"].double()
    # the NLL on the chosen rows: each chosen sequence's token mean, averaged over the pairs
    # (upstream's with its default of one pair per micro-batch)
    nll = (-(lp * m).sum(1) / m.sum(1))[0::2]
    if name == "cross_entropy":
        return -(lp * m).sum() / m.sum()
    if name == "cpo":   # upstream Twinkle's CPOLoss: reference-free DPO + bc_coef * chosen NLL
        c = (lp * m).sum(1)
        return (-F.logsigmoid(kw["beta"] * (c[0::2] - c[1::2])) + kw["bc_coef"] * nll).mean()
    if name == "orpo":  # upstream Twinkle's ORPOLoss: chosen NLL + lambda * odds-ratio term
        avg = (lp * m).sum(1) / m.sum(1)
        log_odds = avg - torch.log(1 - torch.exp(avg))
        return (nll - kw["lambda_orpo"] * F.logsigmoid(log_odds[0::2] - log_odds[1::2])).mean()
    if name == "sapo":  # upstream Twinkle's SAPOLoss: the soft gate in GRPO's place, GRPO's mean
        ratio, a = torch.exp(lp - old), adv[:, None]
        tau = torch.where(a > 0, torch.tensor(kw["tau_pos"]), torch.tensor(kw["tau_neg"])).double()
        tok = (-torch.sigmoid(tau * (ratio - 1)) * 4 / tau * a + kw.get("beta", 0.0) * _k3(lp, ref)) * m
        return (tok.sum(1) / m.sum(1)).mean()
    if name == "dpo":   # upstream Twinkle's DPOLoss: summed log-probs, pairs (2k chosen, 2k + 1 rejected)
        beta, kind = kw["beta"], kw.get("loss_type", "sigmoid")
        ratio = ((lp if kw.get("reference_free") else lp - ref) * m).sum(1)
        c, r = ratio[0::2], ratio[1::2]
        z = beta * (c - r)
        if kind == "hinge":
            return torch.relu(1 - z).mean()
        if kind == "ipo":
            return ((z - 1 / (2 * beta)) ** 2).mean()
        if kind == "kto_pair":
            return (1 - torch.sigmoid(beta * c) + torch.sigmoid(beta * r)).mean()
        ls = kw.get("label_smoothing", 0.0)
        return (-(1 - ls) * F.logsigmoid(z) - ls * F.logsigmoid(-z) + kw.get("sft_weight", 0.0) * nll).mean()
    if name == "simpo":   # upstream Twinkle's SimPOLoss: length-normalised log-probs, no reference
        avg = (lp * m).sum(1) / m.sum(1)
        return -F.logsigmoid(kw["beta"] * (avg[0::2] - avg[1::2]) - kw["gamma"]).mean()
    if name == "gspo":   # sequence level, as in the paper
        s = torch.exp(((lp - old) * m).sum(1) / m.sum(1))
        return -torch.minimum(s * adv, s.clamp(1 - kw["epsilon"], 1 + kw["epsilon_high"]) * adv).mean()
    if name == "cispo":
        w = torch.exp(lp - old).clamp(1 - kw["epsilon"], 1 + kw["epsilon_high"]).detach()
        return (-(w * adv[:, None] * lp) * m).sum() / m.sum()
    if kw.get("onpolicy"):
        old = lp.detach()
    p = dict(epsilon=0.2, epsilon_high=None, beta=0.0, entropy_coef=0.0)
    p.update({k: v for k, v in kw.items() if k in p})
    p["epsilon_high"] = p["epsilon"] if p["epsilon_high"] is None else p["epsilon_high"]
    tok = _policy_token_loss(lp, old, adv, ref, ent, **p) * m
    if name == "grpo":
        return (tok.sum(1) / m.sum(1)).mean()
    if name == "bnpo":
        return tok.sum() / m.sum()
    if name == "dr_grpo":   # upstream Twinkle's DRGRPOLoss: a fixed length, max_completion_length=1024
        return tok.sum() / (lp.shape[0] * (kw.get("max_length") or 1024))
    raise KeyError(name)


def tiny_qwen3_folder(root):
    """(the transformers model, its folder): a 2-layer Qwen3 of vocabulary VOCAB, seed 0, fp32,
    saved under ``root``/qwen3."""
    from transformers import AutoModelForCausalLM, Qwen3Config
    cfg = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                      max_position_embeddings=64, intermediate_size=128, num_hidden_layers=2,
                      head_dim=16, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg).float()
    model_dir = str(root / "qwen3")
    hf.save_pretrained(model_dir)
    return hf, model_dir


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("losses")
    hf, model_dir = tiny_qwen3_folder(root)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (B, SEQ), generator=g)
    labels = ids.clone()
    for b, p in enumerate([3, 5, 2, 6]):   # prompts
        labels[b, :p] = -100
    labels[3, 13:] = -100                  # a short answer
    with torch.no_grad():
        lp, ent = _token_stats(hf(input_ids=ids).logits, labels)
        lp_t, ent_t = _token_stats(hf(input_ids=ids).logits, labels, temperature=0.7)
    mask = labels != -100
    mask[:, 0] = False
    data = {"ids": ids, "labels": labels, "loss_mask": mask,
            "advantages": torch.randn(B, generator=g),
            # far enough from the current policy that some ratios clip, some do not
            "old_logps": ((lp + 0.3 * torch.randn(B, SEQ, generator=g)) * mask).float(),
            "ref_logps": ((lp + 0.2 * torch.randn(B, SEQ, generator=g)) * mask).float()}
    # packed rows: two samples each, position_ids restarting, the second sample's first label -100
    p_ids, p_labels, p_pos, p_lp, p_ent = [], [], [], [], []
    for n1, n2 in PACKED:
        s_ids = [torch.randint(0, VOCAB, (n,), generator=g) for n in (n1, n2)]
        row_lp, row_ent = [], []
        for t in s_ids:
            with torch.no_grad():
                a, e = _token_stats(hf(input_ids=t[None]).logits, t[None])
            row_lp.append(a[0]), row_ent.append(e[0])
        lab = torch.cat(s_ids).clone()
        lab[n1] = -100
        p_ids.append(torch.cat(s_ids)), p_labels.append(lab)
        p_pos.append(torch.cat([torch.arange(n1), torch.arange(n2)]))
        p_lp.append(torch.cat(row_lp)), p_ent.append(torch.cat(row_ent))
    data.update(packed_input_ids=torch.stack(p_ids), packed_labels=torch.stack(p_labels),
                packed_position_ids=torch.stack(p_pos))
    torch.save(data, str(root / "data.pt"))
    refs = {"plain": (lp, ent), "temperature": (lp_t, ent_t),
            "packed": (torch.stack(p_lp), torch.stack(p_ent))}
    return {"hf": hf, "model_dir": model_dir, "data": data, "refs": refs, "root": root}


def reference_loss_and_norm(setup, name, kw):
    hf, d = setup["hf"], setup["data"]
    hf.zero_grad()
    logits = hf(input_ids=d["ids"]).logits
    lp, ent = _token_stats(logits, d["labels"])
    loss = reference_loss(name, kw, lp, ent, d["loss_mask"], d)
    loss.backward()
    norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in hf.parameters() if p.grad is not None))
    return float(loss.detach()), norm


CASES = {   # id -> (loss, kwargs, per-sample args, extra case fields)
    "ce": ("cross_entropy", {}, [], {}),
    "grpo": ("grpo", GRPO_KW, ARGS, {}),
    "grpo_mbs1": ("grpo", GRPO_KW, ARGS, {"mbs": 1}),
    "grpo_response_only": ("grpo", GRPO_KW, ARGS, {"response_only": ["old_logps", "ref_logps"]}),
    "grpo_accumulate": ("grpo", GRPO_KW, ARGS, {"accumulate": True}),
    "grpo_onpolicy": ("grpo", {}, ["advantages"], {}),
    "dr_grpo": ("dr_grpo", {"epsilon": 0.2}, ["advantages", "old_logps"], {"mbs": 1}),
    "bnpo": ("bnpo", {"epsilon": 0.2, "beta": 0.1}, ARGS, {"mbs": 2}),
    "gspo": ("gspo", {"epsilon": 0.1, "epsilon_high": 0.15}, ["advantages", "old_logps"], {}),
    "cispo": ("cispo", {"epsilon": 0.2, "epsilon_high": 0.2}, ["advantages", "old_logps"], {}),
    "dpo": ("dpo", {"beta": 0.5, "label_smoothing": 0.1}, ["ref_logps"], {"mbs": 2}),
    "dpo_hinge": ("dpo", {"beta": 0.5, "loss_type": "hinge"}, ["ref_logps"], {"mbs": 2}),
    "dpo_ipo": ("dpo", {"beta": 0.5, "loss_type": "ipo"}, ["ref_logps"], {"mbs": 2}),
    "dpo_kto_pair": ("dpo", {"beta": 0.5, "loss_type": "kto_pair"}, ["ref_logps"], {"mbs": 2}),
    "dpo_reference_free": ("dpo", {"beta": 0.05, "reference_free": True}, [], {"mbs": 2}),
    "simpo": ("simpo", {"beta": 2.5, "gamma": 0.5}, [], {"mbs": 2}),
    "dpo_sft": ("dpo", {"beta": 0.5, "sft_weight": 0.7}, ["ref_logps"], {"mbs": 2}),
    "cpo": ("cpo", {"beta": 0.2, "bc_coef": 0.5}, [], {"mbs": 2}),
    "orpo": ("orpo", {"lambda_orpo": 0.3}, [], {"mbs": 2}),
    "sapo": ("sapo", {"tau_pos": 1.5, "tau_neg": 0.6, "beta": 0.04}, ARGS, {}),
}
REF_KW = {"grpo_onpolicy": {"onpolicy": True}}


def _case(cid):
    name, kw, args, extra = CASES[cid]
    return {"id": cid, "loss": name, "kwargs": kw, "args": args, **extra}


BAD = [
    {"id": "adv_shape", "loss": "grpo", "args": {"advantages": [[0.1, 0.2]] * 4}},
    {"id": "adv_rows", "loss": "grpo", "args": {"advantages": [0.1, 0.2, 0.3]}},
    {"id": "old_length", "loss": "grpo", "args": {"advantages": [0.0] * 4, "old_logps": [[0.0] * 5] * 4}},
    {"id": "missing_adv", "loss": "grpo", "args": {}},
    {"id": "unknown_kwarg", "loss": "grpo", "args": {"advantages": [0.0] * 4, "rewards": [1.0] * 4}},
    {"id": "dpo_odd", "loss": "dpo", "args": {"ref_logps": torch.zeros(B, SEQ).tolist()}, "mbs": 1},
]


@pytest.fixture(scope="module")
def results(setup, tmp_path_factory):
    root, model_dir = setup["root"], setup["model_dir"]
    # an hf:// id laid out in a temp Hugging Face cache
    cache = root / "hub"
    snap = cache / "models--tiny-org--tiny-qwen3" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    for f in os.listdir(model_dir):
        os.symlink(os.path.join(model_dir, f), snap / f)
    (cache / "models--tiny-org--tiny-qwen3" / "refs").mkdir()
    (cache / "models--tiny-org--tiny-qwen3" / "refs" / "main").write_text("abc123")
    schedulers = [
        ["CosineWarmupScheduler", {"num_warmup_steps": 2, "num_training_steps": 6}],
        ["LinearWarmupScheduler", {"lr_warmup_steps": 2, "lr_decay_steps": 6}],
        ["CosineAnnealingLR", {"T_max": 4, "eta_min": 1e-4}],
        ["LinearLR", {"total_iters": 4}],
        ["constant", {"num_warmup_steps": 2}],
        ["default", {"lr_decay_steps": 4, "max_lr": 2e-3}],
    ]
    single_cases = [_case(c) for c in CASES]
    one = {"data": str(root / "data.pt"), "model_dir": model_dir, "runs": [
        {"name": "single", "mesh": {"world_size": 1}, "forward_only": ["plain", "temperature", "packed"],
         "losses": single_cases},
        {"name": "bad", "mesh": {"world_size": 1}, "bad": BAD},
        {"name": "signatures", "mesh": {"world_size": 1}, "signatures": True,
         "model_id": "hf://tiny-org/tiny-qwen3", "schedulers": schedulers,
         "env": {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}},
        {"name": "fp16", "mesh": {"world_size": 1}, "signatures": True, "mixed_precision": "fp16",
         "model_id": model_dir, "schedulers": [], "env": {}},
    ]}
    two_cases = [_case(c) for c in ("grpo", "gspo", "dpo", "dpo_ipo", "simpo", "dpo_sft", "cpo", "orpo", "sapo")]
    two = {"data": str(root / "data.pt"), "model_dir": model_dir, "runs": [
        {"name": "tp2", "mesh": {"tp_size": 2}, "forward_only": ["plain", "packed"], "losses": two_cases},
        {"name": "tp2_sp", "mesh": {"tp_size": 2, "sequence_parallel": True},
         "forward_only": ["plain", "packed"], "losses": two_cases},
        {"name": "pp2", "mesh": {"pp_size": 2}, "forward_only": ["plain"], "mbs": 2,
         "losses": [_case("grpo_mbs1"), _case("dpo"), _case("dpo_hinge"), _case("orpo")]},
        {"name": "cp2", "mesh": {"cp_size": 2}, "forward_only": ["plain"], "losses": two_cases},
        {"name": "dp2", "mesh": {"dp_size": 2}, "forward_only": ["plain", "packed"],
         "losses": [_case(c) for c in ("grpo", "bnpo", "dr_grpo", "dpo", "dpo_kto_pair", "dpo_reference_free",
                                       "dpo_sft", "cpo", "sapo")]},
    ]}
    out = {}
    for n, spec in ((1, one), (2, two)):
        res, rcs, logs, elapsed = launch(n, spec, str(root / f"run{n}"), timeout=400, script=WORKER)
        assert rcs == [0] * n and all(r is not None for r in res), "\n".join(l[-3000:] for l in logs)
        print(f"[{n} ranks: {elapsed:.1f}s]")
        out[n] = res
    return out


def _rec(results, n, run, rank=0):
    rec = results[n][rank][run]
    assert rec["ok"], rec.get("traceback")
    return rec


# ---- per-token outputs -------------------------------------------------------------------

@pytest.mark.multiprocess
@pytest.mark.parametrize("n, run, rank", [(1, "single", 0), (2, "tp2", 0), (2, "tp2", 1), (2, "tp2_sp", 1),
                                          (2, "pp2", 0), (2, "pp2", 1), (2, "cp2", 0), (2, "cp2", 1),
                                          (2, "dp2", 0), (2, "dp2", 1)])
def test_logps_and_entropy_equal_log_softmax_of_transformers(setup, results, n, run, rank):
    rec = _rec(results, n, run, rank)
    dp = rank if run == "dp2" else 0
    rows = slice(2 * dp, 2 * dp + 2) if run == "dp2" else slice(None)
    errors = {}
    for kind in ("plain", "temperature", "packed"):
        if "fo_" + kind not in rec:
            continue
        lp_ref, ent_ref = setup["refs"][kind]
        lp, ent = torch.tensor(rec["fo_" + kind]["logps"]), torch.tensor(rec["fo_" + kind]["entropy"])
        errors[kind] = (float((lp - lp_ref[rows]).abs().max()), float((ent - ent_ref[rows]).abs().max()))
        assert lp.shape == lp_ref[rows].shape
    print(run, rank, errors)
    assert errors and all(max(e) <= 1e-5 for e in errors.values()), errors


# ---- losses and their gradients -----------------------------------------------------------

@pytest.mark.multiprocess
@pytest.mark.parametrize("cid", list(CASES))
def test_loss_and_grad_norm_equal_the_formula_single(setup, results, cid):
    rec = _rec(results, 1, "single")[cid]
    loss, norm = reference_loss_and_norm(setup, CASES[cid][0], {**CASES[cid][1], **REF_KW.get(cid, {})})
    assert abs(rec["loss"] - loss) <= 1e-5 * max(1, abs(loss)), (rec["loss"], loss)
    assert abs(rec["norm"] - norm) <= 1e-4 * max(1, norm), (rec["norm"], norm)
    assert norm > 1e-3   # a loss that moves the weights


@pytest.mark.multiprocess
@pytest.mark.parametrize("run, cid", [("tp2", "grpo"), ("tp2", "gspo"), ("tp2", "dpo"), ("tp2", "dpo_ipo"), ("tp2", "simpo"),
                                      ("tp2_sp", "grpo"), ("tp2_sp", "gspo"), ("tp2_sp", "dpo"), ("tp2_sp", "dpo_ipo"),
                                      ("pp2", "grpo_mbs1"), ("pp2", "dpo"), ("pp2", "dpo_hinge"),
                                      ("cp2", "grpo"), ("cp2", "gspo"), ("cp2", "dpo"), ("cp2", "dpo_ipo"), ("cp2", "simpo"),
                                      ("dp2", "grpo"), ("dp2", "bnpo"), ("dp2", "dr_grpo"), ("dp2", "dpo"),
                                      ("dp2", "dpo_kto_pair"), ("dp2", "dpo_reference_free"),
                                      ("tp2", "dpo_sft"), ("tp2", "cpo"), ("tp2", "orpo"), ("tp2", "sapo"),
                                      ("tp2_sp", "cpo"), ("tp2_sp", "sapo"), ("pp2", "orpo"),
                                      ("cp2", "dpo_sft"), ("cp2", "cpo"), ("cp2", "orpo"), ("cp2", "sapo"),
                                      ("dp2", "dpo_sft"), ("dp2", "cpo"), ("dp2", "sapo")])
def test_loss_and_grad_norm_equal_the_formula_two_ranks(setup, results, run, cid):
    loss, norm = reference_loss_and_norm(setup, CASES[cid][0], CASES[cid][1])
    for rank in (0, 1):
        rec = _rec(results, 2, run, rank)[cid]
        assert abs(rec["loss"] - loss) <= 1e-5 * max(1, abs(loss)), (rank, rec["loss"], loss)
        assert abs(rec["norm"] - norm) <= 1e-4 * max(1, norm), (rank, rec["norm"], norm)


@pytest.mark.multiprocess
def test_grpo_metrics_report_clipping_and_kl(setup, results):
    rec = _rec(results, 1, "single")["grpo"]
    d = setup["data"]
    lp, _ = setup["refs"]["plain"]
    m = d["loss_mask"]
    ratio = torch.exp(lp - d["old_logps"].double())
    a = d["advantages"][:, None]
    clipped = (((ratio < 0.8) & (a < 0)) | ((ratio > 1.28) & (a > 0))) & m
    assert 0 < rec["clip_frac"] < 1
    assert abs(rec["clip_frac"] - float(clipped.sum()) / float(m.sum())) < 1e-9
    kl = float((_k3(lp, d["ref_logps"].double()) * m).sum() / m.sum())
    assert abs(rec["kl"] - kl) < 1e-5


# ---- bad input and the guide's signatures --------------------------------------------------

@pytest.mark.multiprocess
@pytest.mark.parametrize("cid, error, words", [
    ("adv_shape", "ValueError", ["advantages"]),
    ("adv_rows", "ValueError", ["advantages", "[B]=4"]),
    ("old_length", "ValueError", ["old_logps[0]", "length 5"]),
    ("missing_adv", "ValueError", ["advantages"]),
    ("unknown_kwarg", "TypeError", ["rewards"]),
    ("dpo_odd", "ValueError", ["pairs", "micro-batch has 1 sequences"]),
])
def test_bad_loss_arguments_are_clear_errors(results, cid, error, words):
    rec = _rec(results, 1, "bad")
    assert rec[cid]["raised"] == error, rec[cid]
    for w in words:
        assert w in rec[cid]["message"], rec[cid]
    assert math.isfinite(rec["after_bad"])


def test_unknown_losses_and_kwargs_are_clear_errors():
    from twinkle_megatron.training import losses
    with pytest.raises(ValueError, match="unknown loss 'ppo'"):
        losses.resolve_loss("ppo")
    with pytest.raises(TypeError, match=r"unknown argument\(s\) \['epsilonn'\]"):
        losses.resolve_loss("grpo", epsilonn=0.2)
    assert isinstance(losses.resolve_loss("GRPOLoss", epsilon=0.1), losses.GRPOLoss)
    assert isinstance(losses.resolve_loss("DrGRPOLoss"), losses.DrGRPOLoss)
    assert isinstance(losses.resolve_loss(losses.CISPOLoss), losses.CISPOLoss)
    mine = losses.BNPOLoss()
    assert losses.resolve_loss(mine) is mine
    with pytest.raises(TypeError, match="need a loss name or class"):
        losses.resolve_loss(mine, beta=1.0)
    with pytest.raises(ValueError, match="epsilon"):
        losses.GRPOLoss(epsilon=-1)


def test_dpo_odd_sequences_raise():
    from twinkle_megatron.training import losses
    x = losses.LossInputs(logps=torch.zeros(3, 4), loss_mask=torch.ones(3, 4, dtype=torch.bool),
                          segment_ids=torch.arange(3)[:, None].expand(3, 4), num_segments=3,
                          ref_logps=torch.zeros(3, 4))
    with pytest.raises(ValueError, match="pairs"):
        losses.DPOLoss()(x)


@pytest.mark.multiprocess
def test_guide_signatures(setup, results):
    rec = _rec(results, 1, "signatures")
    assert rec["model_dir"].endswith(os.path.join("snapshots", "abc123"))
    lrs = rec["lrs"]
    cos = lambda f: 0.5 * (1 + math.cos(math.pi * f))  # noqa: E731
    expect = {
        "CosineWarmupScheduler": [5e-4, 1e-3, 1e-3 * cos(1 / 4), 1e-3 * cos(2 / 4)],
        "LinearWarmupScheduler": [5e-4, 1e-3, 1e-3 * 3 / 4, 1e-3 * 2 / 4],
        "CosineAnnealingLR": [1e-4 + 9e-4 * cos(i / 4) for i in (1, 2, 3, 4)],
        "LinearLR": [1e-3 * (1 - i / 4) for i in (1, 2, 3, 4)],
        "constant": [5e-4, 1e-3, 1e-3, 1e-3],
        "default": [2e-3 * cos(i / 4) for i in (1, 2, 3, 4)],
    }
    for name, want in expect.items():
        assert all(abs(a - b) < 1e-12 for a, b in zip(lrs[name], want)), (name, lrs[name], want)
    # a step every second call
    assert rec["steps"] == [0, 1, 1, 2]
    assert rec["norms"][0] is None and rec["norms"][2] is None and rec["norms"][1] > 0


@pytest.mark.multiprocess
def test_fp16_loss_scaling_trains(results):
    rec = _rec(results, 1, "fp16")
    assert all(math.isfinite(x) for x in rec["losses"])
    assert rec["norms"][1] is not None and rec["norms"][3] is not None


def test_hub_ids_resolve_offline_and_errors_name_the_paths(tmp_path, monkeypatch):
    from twinkle_megatron.hub import resolve_model_id
    snap = tmp_path / "hf" / "models--org--name" / "snapshots" / "r1"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))   # read at call time
    assert resolve_model_id("hf://org/name") == str(snap)      # no refs/main: latest snapshot
    assert resolve_model_id("hf://org/name@r1") == str(snap)
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    with pytest.raises(FileNotFoundError) as err:
        resolve_model_id("hf://org/name")
    assert "hf://org/name" in str(err.value) and str(tmp_path / "home" / "hub") in str(err.value)
    ms = tmp_path / "ms" / "models" / "Qwen" / "Qwen2___5-0___5B"
    ms.mkdir(parents=True)
    (ms / "config.json").write_text("{}")
    monkeypatch.setenv("MODELSCOPE_CACHE", str(tmp_path / "ms"))
    assert resolve_model_id("ms://Qwen/Qwen2.5-0.5B") == str(ms)
    with pytest.raises(ValueError, match="org/name"):
        resolve_model_id("hf://justname")
    assert resolve_model_id(str(tmp_path)) == str(tmp_path)


def test_per_token_argument_forms():
    from twinkle_megatron.training.losses import per_token_argument
    labels = torch.tensor([[-100, 5, 6, -100], [-100, -100, 7, 8]])
    mask = labels != -100
    assert per_token_argument("a", [1.0, 2.0], labels, mask).tolist() == [[1.0] * 4, [2.0] * 4]
    full = torch.arange(8.).reshape(2, 4)
    assert torch.equal(per_token_argument("a", full, labels, mask), full)
    resp = per_token_argument("a", [[1.0, 2.0], [3.0, 4.0]], labels, mask)
    assert resp.tolist() == [[0, 1, 2, 0], [0, 0, 3, 4]]
    with pytest.raises(ValueError, match=r"a\[1\] has length 3"):
        per_token_argument("a", [[1.0, 2.0], [3.0, 4.0, 5.0]], labels, mask)
    with pytest.raises(ValueError, match="a must be"):
        per_token_argument("a", torch.zeros(2, 4, 1), labels, mask)


def test_vocab_parallel_logps_float64_and_grad():
    from twinkle_megatron.layers.vocab_parallel import vocab_parallel_logps
    torch.manual_seed(0)
    z = torch.randn(3, 7, 11, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 11, (3, 7))
    lp, ent = vocab_parallel_logps(z, t, with_entropy=True, temperature=0.7)
    ls = torch.log_softmax(z / 0.7, -1)
    rlp, rent = ls.gather(-1, t[..., None])[..., 0], -(ls.exp() * ls).sum(-1)
    assert (lp - rlp).abs().max() < 1e-12 and (ent - rent).abs().max() < 1e-12
    w1, w2 = torch.randn(3, 7, dtype=torch.float64), torch.randn(3, 7, dtype=torch.float64)
    g = torch.autograd.grad((lp * w1 + ent * w2).sum(), z)[0]
    gr = torch.autograd.grad((rlp * w1 + rent * w2).sum(), z)[0]
    assert (g - gr).abs().max() < 1e-12
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logps(z, t, temperature=0)


def test_dpo_variants_refuse_what_upstream_refuses():
    from twinkle_megatron.training import losses
    with pytest.raises(ValueError, match="loss_type must be one of"):
        losses.DPOLoss(loss_type="robust")
    with pytest.raises(ValueError, match="label_smoothing=0.1 applies to loss_type='sigmoid' only"):
        losses.DPOLoss(loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match="sft_weight must be a finite number >= 0"):
        losses.DPOLoss(sft_weight=-0.5)     # sft_weight > 0: tests/megatron/test_dpo_family.py
    assert losses.DPOLoss(reference_free=True).required == () and losses.DPOLoss().required == ("ref_logps",)
