"""Upstream Twinkle's preference and soft-gated losses: ``DPOLoss(sft_weight=)``, ``CPOLoss``,
``ORPOLoss`` and ``SAPOLoss`` against float64 plain-torch formulas written here from the papers
and upstream's definitions, on random inputs (values and gradients; packed samples; several
micro-batches), then one ``MegatronModel.forward_backward`` step per loss against the same
formula on the log-probs the step returns."""
import math

import pytest
import torch
import torch.nn.functional as F

from twinkle_megatron.training import losses


# ---- references: one list entry per sequence (1-D float64 log-probs of its loss tokens) -------

def _nll(seqs):
    """[pairs]: each chosen sequence's token-mean NLL (upstream's term with one pair per micro-batch)."""
    return torch.stack([-s.mean() for s in seqs[0::2]])


def _nll_tokens(seqs):
    """The nll metric: the token mean over every chosen token."""
    chosen = seqs[0::2]
    return -sum(s.sum() for s in chosen) / sum(len(s) for s in chosen)


def ref_dpo_sft(seqs, refs, beta, w):
    c = torch.stack([s.sum() - r.sum() for s, r in zip(seqs[0::2], refs[0::2])])
    r = torch.stack([s.sum() - q.sum() for s, q in zip(seqs[1::2], refs[1::2])])
    return (-F.logsigmoid(beta * (c - r)) + w * _nll(seqs)).mean()


def ref_cpo(seqs, beta, bc_coef):
    c = torch.stack([s.sum() for s in seqs[0::2]])
    r = torch.stack([s.sum() for s in seqs[1::2]])
    return (-F.logsigmoid(beta * (c - r)) + bc_coef * _nll(seqs)).mean()


def ref_orpo(seqs, lam):
    def log_odds(s):    # the paper: log(p / (1 - p)), p the geometric-mean token probability
        p = s.mean().exp()
        return torch.log(p) - torch.log(1 - p)
    ratio = torch.stack([log_odds(c) - log_odds(r) for c, r in zip(seqs[0::2], seqs[1::2])])
    return (_nll(seqs) - lam * F.logsigmoid(ratio)).mean()


def ref_sapo(seqs, olds, advs, tau_pos, tau_neg, beta=0.0, refs=None):
    per_seq = []
    for i, (s, o, a) in enumerate(zip(seqs, olds, advs)):
        r = torch.exp(s - o)
        tau = tau_pos if a > 0 else tau_neg
        gate = 4.0 / tau / (1 + torch.exp(-tau * (r - 1)))
        tok = -gate * a
        if beta:
            d = refs[i] - s
            tok = tok + beta * (d.exp() - d - 1)
        per_seq.append(tok.mean())
    return torch.stack(per_seq).mean()


# ---- LossInputs from sequences, packed two per row or one per row ---------------------------

def _inputs(lengths, packed, g, pad=2):
    """Random float64 logps laid out as the facade hands them over: rows of ``pad`` leading
    masked positions then the sequences (two per row when ``packed``)."""
    groups = [lengths[i:i + 2] for i in range(0, len(lengths), 2)] if packed else [[n] for n in lengths]
    width = max(sum(n + pad for n in grp) for grp in groups) + 1
    n_rows = len(groups)
    logps = torch.zeros(n_rows, width, dtype=torch.float64)
    mask = torch.zeros(n_rows, width, dtype=torch.bool)
    seg = torch.zeros(n_rows, width, dtype=torch.int64)
    spans, k = [], 0
    for row, grp in enumerate(groups):
        at = 0
        for n in grp:
            seg[row, at:at + n + pad] = k
            logps[row, at + pad:at + pad + n] = -torch.rand(n, generator=g, dtype=torch.float64) * 3 - 0.05
            mask[row, at + pad:at + pad + n] = True
            spans.append((row, at + pad, at + pad + n))
            at += n + pad
            k += 1
        seg[row, at:] = k - 1      # trailing padding: the last sequence's, masked
    logps.requires_grad_(True)
    x = losses.LossInputs(logps=logps, loss_mask=mask, segment_ids=seg, num_segments=k)
    return x, spans


def _seqs(t, spans):
    return [t[r, a:b] for r, a, b in spans]


def _per_token(x, spans, values):
    out = torch.zeros_like(x.logps, dtype=torch.float64)
    for (r, a, b), v in zip(spans, values):
        out[r, a:b] = v
    return out


def _check(loss, x, spans, reference):
    total, count = loss(x)[:2]
    got = total / count.double()
    (g_got,) = torch.autograd.grad(got, x.logps)
    want = reference(_seqs(x.logps, spans))
    (g_want,) = torch.autograd.grad(want, x.logps)
    got, want = float(got.detach()), float(want.detach())
    assert abs(got - want) <= 1e-12 * max(1.0, abs(want)), (got, want)
    assert float((g_got - g_want).abs().max()) <= 1e-12
    assert float(g_want.abs().max()) > 1e-3
    return loss(x)


LENGTHS = [5, 3, 7, 2, 4, 6]


@pytest.mark.parametrize("packed", [False, True])
def test_dpo_sft_weight_cpo_orpo_equal_their_formulas(packed):
    g = torch.Generator().manual_seed(11)
    x, spans = _inputs(LENGTHS, packed, g)
    ref = torch.where(x.loss_mask, x.logps.detach() + 0.3 * torch.randn(x.logps.shape, generator=g,
                                                                         dtype=torch.float64), 0.0)
    x.ref_logps = ref
    refs = _seqs(ref, spans)
    _, _, m = _check(losses.DPOLoss(beta=0.3, sft_weight=0.7), x, spans, lambda s: ref_dpo_sft(s, refs, 0.3, 0.7))
    nll = _nll_tokens(_seqs(x.logps.detach(), spans))
    assert abs(float(m["nll"][0] / m["nll"][1]) - float(nll)) <= 1e-12
    _, _, m = _check(losses.CPOLoss(beta=0.2, bc_coef=0.5), x, spans, lambda s: ref_cpo(s, 0.2, 0.5))
    c = torch.stack([s.sum() for s in _seqs(x.logps.detach(), spans)])
    assert abs(float(m["margin"][0] / m["margin"][1]) - float((c[0::2] - c[1::2]).mean())) <= 1e-12
    assert float(m["reward_acc"][0]) == float((c[0::2] > c[1::2]).sum()) and int(m["reward_acc"][1]) == 3
    _check(losses.ORPOLoss(lambda_orpo=0.25), x, spans, lambda s: ref_orpo(s, 0.25))
    # the upstream defaults
    _check(losses.CPOLoss(), x, spans, lambda s: ref_cpo(s, 0.1, 1.0))
    _check(losses.ORPOLoss(), x, spans, lambda s: ref_orpo(s, 0.1))
    # sft_weight=0 is plain DPO (no nll metric)
    assert "nll" not in losses.DPOLoss().metric_names
    assert losses.DPOLoss(sft_weight=0.5).metric_names == ("reward_acc", "margin", "nll")


def test_orpo_near_probability_one_is_finite():
    g = torch.Generator().manual_seed(2)
    x, spans = _inputs([3, 3], False, g)
    with torch.no_grad():
        x.logps[0, 2:5] = 0.0        # the chosen sequence has probability 1 exactly
    total, count = losses.ORPOLoss()(x)[:2]
    (grad,) = torch.autograd.grad(total / count, x.logps)
    assert math.isfinite(float(total.detach())) and bool(torch.isfinite(grad).all())
    # log1mexp against the direct formula where the direct one is accurate
    a = -torch.logspace(-6, 2, 50, dtype=torch.float64)
    assert float((losses.log1mexp(a) - torch.log(1 - torch.exp(a))).abs().max()) <= 1e-9


@pytest.mark.parametrize("beta", [0.0, 0.05])
@pytest.mark.parametrize("packed", [False, True])
def test_sapo_equals_its_formula(packed, beta):
    g = torch.Generator().manual_seed(5)
    x, spans = _inputs(LENGTHS, packed, g)
    lp = x.logps.detach()
    old = torch.where(x.loss_mask, lp + 0.4 * torch.randn(lp.shape, generator=g, dtype=torch.float64), 0.0)
    ref = torch.where(x.loss_mask, lp + 0.2 * torch.randn(lp.shape, generator=g, dtype=torch.float64), 0.0)
    advs = torch.randn(len(spans), generator=g, dtype=torch.float64)
    x.old_logps, x.ref_logps = old, ref
    x.advantages = _per_token(x, spans, advs)
    olds, refs = _seqs(old, spans), _seqs(ref, spans)
    _, _, m = _check(losses.SAPOLoss(beta=beta, tau_pos=1.5, tau_neg=0.6), x, spans,
                     lambda s: ref_sapo(s, olds, advs, 1.5, 0.6, beta, refs))
    assert float(m["clip_frac"][0]) == 0.0
    # on-policy, the gate's slope at r = 1 is 1: the gradient is GRPO's (the policy gradient)
    x.old_logps = None
    sapo = losses.SAPOLoss(tau_pos=2.0, tau_neg=3.0)(x)
    grpo = losses.GRPOLoss()(x)
    g_sapo = torch.autograd.grad(sapo[0] / sapo[1], x.logps)[0]
    g_grpo = torch.autograd.grad(grpo[0] / grpo[1], x.logps)[0]
    assert float((g_sapo - g_grpo).abs().max()) <= 1e-12


def test_split_into_micro_batches_changes_nothing():
    """The NLL term is per pair: micro-batches of 2 and 1 pairs give the loss of all 3 pairs."""
    g = torch.Generator().manual_seed(8)
    parts = [_inputs(LENGTHS[:4], False, g), _inputs(LENGTHS[4:], True, g)]
    for loss, reference in ((losses.CPOLoss(beta=0.2, bc_coef=0.5), lambda s: ref_cpo(s, 0.2, 0.5)),
                            (losses.ORPOLoss(lambda_orpo=0.3), lambda s: ref_orpo(s, 0.3))):
        totals = [loss(x)[:2] for x, _ in parts]
        got = sum(t for t, _ in totals) / sum(c for _, c in totals)
        want = reference([s for x, spans in parts for s in _seqs(x.logps, spans)])
        assert abs(float(got.detach()) - float(want.detach())) <= 1e-12


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="sft_weight must be a finite number >= 0"):
        losses.DPOLoss(sft_weight=-1.0)
    with pytest.raises(ValueError, match="bc_coef"):
        losses.CPOLoss(bc_coef=float("nan"))
    with pytest.raises(ValueError, match="beta must be > 0 for cpo"):
        losses.CPOLoss(beta=0.0)
    with pytest.raises(ValueError, match="lambda_orpo"):
        losses.ORPOLoss(lambda_orpo="0.1")
    with pytest.raises(ValueError, match="tau_neg must be > 0"):
        losses.SAPOLoss(tau_neg=0.0)
    g = torch.Generator().manual_seed(1)
    x, _ = _inputs([3, 4, 5], False, g)
    for loss in (losses.CPOLoss(), losses.ORPOLoss()):
        with pytest.raises(ValueError, match=f"{loss.name} needs chosen/rejected pairs: a micro-batch has 3"):
            loss(x)
    for name, cls in (("CPOLoss", losses.CPOLoss), ("orpo", losses.ORPOLoss), ("SAPOLoss", losses.SAPOLoss)):
        assert isinstance(losses.resolve_loss(name), cls)


# ---- one facade step per loss ------------------------------------------------------------------

@pytest.fixture(scope="module")
def model():
    pytest.importorskip("megatron.core")
    from conftest import megatron_one_rank
    from twinkle_megatron.job.configs import tiny_qwen3_config
    with megatron_one_rank() as tm:
        m = tm.MegatronModel(model_id=tiny_qwen3_config(num_layers=1), mixed_precision="fp32")
        m.set_optimizer("AdamW", lr=1e-3)
        yield m


def _batch():
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 256, (4, 12), generator=g)
    labels = ids.clone()
    for b, p in enumerate([3, 5, 4, 2]):
        labels[b, :p] = -100
    labels[1, 10:] = -100
    ref = torch.randn(4, 12, generator=g) * 0.3 - 4.0
    return {"input_ids": ids, "labels": labels}, ref, torch.tensor([1.0, -0.5, 2.0, -1.5])


@pytest.mark.multiprocess
@pytest.mark.parametrize("name, kw", [("dpo", {"beta": 0.4, "sft_weight": 0.6}), ("cpo", {"beta": 0.3, "bc_coef": 0.8}),
                                      ("orpo", {"lambda_orpo": 0.2}), ("sapo", {"tau_pos": 1.2, "tau_neg": 0.7})])
def test_forward_backward_step_equals_the_formula(model, name, kw):
    batch, ref, adv = _batch()
    mask = batch["labels"] != -100
    mask[:, 0] = False
    model.set_loss(name, **kw)
    if name == "dpo":
        args = {"ref_logps": ref * mask}
    elif name == "sapo":
        lp0 = model.forward_only(inputs=batch)["logps"]
        args = {"advantages": adv, "old_logps": (lp0 + 0.2 * ref.sin()) * mask}
    else:
        args = {}
    out = model.forward_backward(inputs=batch, micro_batch_size=4, return_logps=True, **args)
    model.zero_grad()
    model.set_loss("cross_entropy")
    lp = out["logps"].double()
    seqs = [lp[b][mask[b]] for b in range(4)]
    if name == "dpo":
        refs = [args["ref_logps"].double()[b][mask[b]] for b in range(4)]
        want = ref_dpo_sft(seqs, refs, 0.4, 0.6)
    elif name == "cpo":
        want = ref_cpo(seqs, 0.3, 0.8)
    elif name == "orpo":
        want = ref_orpo(seqs, 0.2)
    else:
        olds = [args["old_logps"].double()[b][mask[b]] for b in range(4)]
        want = ref_sapo(seqs, olds, adv.double(), 1.2, 0.7)
    assert abs(out["loss"] - float(want)) <= 1e-5 * max(1.0, abs(float(want))), (out["loss"], float(want))


@pytest.mark.multiprocess
def test_mixed_adapter_batch_equals_each_adapter_alone(model):   # model: the one-rank megatron it runs in
    """One forward_backward(adapter_names=...) over two LoRA adapters, CPO on a's rows and SAPO on
    b's (pairs consecutive among a's rows), equals each adapter's rows sent alone: loss, grad norm."""
    from twinkle_megatron.job.configs import tiny_qwen3_config
    import twinkle_megatron as tm

    def two_adapters():
        m = tm.MegatronModel(model_id=tiny_qwen3_config(num_layers=1), mixed_precision="fp32", seed=5)
        for name in ("a", "b"):
            m.add_adapter_to_model(name, {"r": 4, "target_modules": "all-linear", "init_lora_weights": False})
            m.set_optimizer("AdamW", lr=1e-3, adapter_name=name)
        m.set_loss("cpo", beta=0.3, bc_coef=0.8, adapter_name="a")
        m.set_loss("sapo", tau_pos=1.2, tau_neg=0.7, adapter_name="b")
        return m

    batch, _, adv = _batch()
    g = torch.Generator().manual_seed(9)
    ids = torch.cat([batch["input_ids"], torch.randint(0, 256, (4, 12), generator=g)])
    labels = torch.cat([batch["labels"], batch["labels"].flip(0)])
    labels = torch.where(labels == -100, labels, ids)
    names = ["a", "a", "b", "b", "a", "a", "b", "b"]
    rows = {n: [i for i, m in enumerate(names) if m == n] for n in ("a", "b")}
    advantages = torch.zeros(8)
    advantages[rows["b"]] = adv
    mixed = two_adapters()
    out = mixed.forward_backward(inputs={"input_ids": ids, "labels": labels}, adapter_names=names,
                                 advantages=advantages)
    norms = mixed.clip_grad_and_step(None)
    alone = two_adapters()
    ref = {n: alone.forward_backward(inputs={"input_ids": ids[rows[n]], "labels": labels[rows[n]]}, adapter_name=n,
                                     **({"advantages": adv} if n == "b" else {})) for n in ("a", "b")}
    ref_norms = alone.clip_grad_and_step(None)
    for n in ("a", "b"):
        assert abs(out[n]["loss"] - ref[n]["loss"]) <= 1e-6 * max(1.0, abs(ref[n]["loss"])), (n, out[n], ref[n])
        assert abs(norms[n] - ref_norms[n]) <= 1e-5 * ref_norms[n] and ref_norms[n] > 0, (n, norms, ref_norms)
