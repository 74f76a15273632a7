"""Upstream Twinkle's metric objects through ``MegatronModel.add_metric(DPOMetric, beta=)`` /
``add_metric('GRPOMetric', ...)``: each key against a plain-torch float64 formula written here from
upstream's definitions (TRL's DPO rewards; GRPO's token means, k3 KL and clip ratios), on random
per-token inputs (rows and packed samples) and through the facade's calls and ``calculate_metric``."""
import math
import os

import pytest
import torch

from twinkle_megatron.training import losses, metrics


def _inputs(lengths, packed, g, pad=2):
    """Random float64 LossInputs: ``pad`` masked positions before each sequence, two sequences per
    row when ``packed``; -> (inputs, spans (row, start, end) per sequence)."""
    groups = [lengths[i:i + 2] for i in range(0, len(lengths), 2)] if packed else [[n] for n in lengths]
    width = max(sum(n + pad for n in grp) for grp in groups)
    logps = torch.zeros(len(groups), width, dtype=torch.float64)
    mask = torch.zeros_like(logps, dtype=torch.bool)
    seg = torch.zeros_like(logps, dtype=torch.int64)
    spans, k = [], 0
    for row, grp in enumerate(groups):
        at = 0
        for n in grp:
            seg[row, at:] = k
            logps[row, at + pad:at + pad + n] = -torch.rand(n, generator=g, dtype=torch.float64) * 2 - 0.01
            mask[row, at + pad:at + pad + n] = True
            spans.append((row, at + pad, at + pad + n))
            at, k = at + n + pad, k + 1
    return losses.LossInputs(logps=logps, loss_mask=mask, segment_ids=seg, num_segments=k), spans


def _noisy(x, g, scale):
    return torch.where(x.loss_mask, x.logps + scale * torch.randn(x.logps.shape, generator=g, dtype=torch.float64),
                       torch.zeros((), dtype=torch.float64))


def _reported(pairs, maxima=()):
    return {k: float(s) if k in maxima else float(s) / float(c) for k, (s, c) in pairs.items() if float(c)}


def dpo_reference(pi, ref, beta):
    """TRL's / upstream's DPO metrics from per-sequence sums (chosen 2k, rejected 2k + 1)."""
    out = {"logps/chosen": pi[0::2].mean(), "logps/rejected": pi[1::2].mean()}
    if ref is not None:
        wc, wr = beta * (pi[0::2] - ref[0::2]), beta * (pi[1::2] - ref[1::2])
        out.update({"logps/ref_chosen": ref[0::2].mean(), "logps/ref_rejected": ref[1::2].mean(),
                    "rewards/chosen": wc.mean(), "rewards/rejected": wr.mean(),
                    "rewards/margins": (wc - wr).mean(), "rewards/accuracies": 100 * (wc > wr).double().mean()})
    return {k: float(v) for k, v in out.items()}


def grpo_reference(new, old, adv, ent, eps, eps_high, temperature=1.0, kind="grpo", seqs=None):
    """Upstream's GRPOMetric on flat [tokens] tensors of the loss tokens (``seqs``: the token count
    of each sequence, for GSPO's sequence-level clipping)."""
    new = new * temperature
    out = {"train/mean_new_logp": new.mean()}
    if ent is not None:
        out["train/entropy"] = ent.mean()
    if old is not None:
        old = old * temperature
        d = new - old
        out.update({"train/mean_old_logp": old.mean(), "train/logp_diff_mean": d.mean(),
                    "train/approx_kl": (torch.exp(d) - d - 1).mean(),
                    "train/token_kl_max": (torch.exp(d) - d - 1).max(), "train/token_ratio_max": torch.exp(d).max()})
        if adv is not None:
            if kind == "gspo":
                parts = torch.split(torch.arange(len(d)), seqs)
                r = torch.stack([d[p].mean().exp() for p in parts])
                a = torch.stack([adv[p].mean() for p in parts])
            else:
                r, a = torch.exp(d), adv
            if kind == "cispo":
                low, high = r < 1 - eps, r > 1 + eps_high
            else:
                low, high = (r < 1 - eps) & (a < 0), (r > 1 + eps_high) & (a > 0)
            out.update({"train/clip_ratio_low": low.double().mean(), "train/clip_ratio_high": high.double().mean(),
                        "train/clip_ratio": (low | high).double().mean()})
    return {k: float(v) for k, v in out.items()}


def _close(got, want, tol=1e-12):
    assert set(got) == set(want), (sorted(got), sorted(want))
    for k in want:
        assert abs(got[k] - want[k]) <= tol * max(1.0, abs(want[k])), (k, got[k], want[k])


@pytest.mark.parametrize("packed", [False, True])
def test_dpo_metric_equals_trl_formulas(packed):
    g = torch.Generator().manual_seed(3)
    x, spans = _inputs([4, 6, 3, 5, 7, 2], packed, g)
    pi = torch.stack([x.logps[r, a:b].sum() for r, a, b in spans])
    _close(_reported(metrics.DPOMetric(beta=0.3)(x)), dpo_reference(pi, None, 0.3))
    x.ref_logps = _noisy(x, g, 0.3)
    for (r, a, b), c in zip(spans, [-4.0, 4.0, 4.0, -4.0, 0.0, 0.0]):    # pair 0 preferred, pair 1 not
        x.ref_logps[r, a:b] += c / (b - a)
    ref = torch.stack([x.ref_logps[r, a:b].sum() for r, a, b in spans])
    want = dpo_reference(pi, ref, 0.3)
    _close(_reported(metrics.DPOMetric(beta=0.3)(x)), want)
    assert 0 < want["rewards/accuracies"] < 100
    with pytest.raises(ValueError, match="DPOMetric needs chosen/rejected pairs: a micro-batch has 5"):
        metrics.DPOMetric()(_inputs([4, 6, 3, 5, 7], packed, g)[0])


@pytest.mark.parametrize("cls, kind", [(metrics.GRPOMetric, "grpo"), (metrics.GSPOMetric, "gspo"),
                                       (metrics.CISPOMetric, "cispo")])
@pytest.mark.parametrize("packed", [False, True])
def test_grpo_metrics_equal_upstream_formulas(cls, kind, packed):
    g = torch.Generator().manual_seed(9)
    lengths = [5, 3, 6, 4]
    x, spans = _inputs(lengths, packed, g)
    flat = lambda t: torch.cat([t[r, a:b] for r, a, b in spans])   # noqa: E731
    m = cls(epsilon=0.1, epsilon_high=0.15, temperature=0.8)
    _close(_reported(m(x), m.max_names), grpo_reference(flat(x.logps), None, None, None, 0.1, 0.15, 0.8))
    x.old_logps = _noisy(x, g, 0.3)
    x.entropy = torch.where(x.loss_mask, torch.rand(x.logps.shape, generator=g, dtype=torch.float64), 0.0)
    want = grpo_reference(flat(x.logps), flat(x.old_logps), None, flat(x.entropy), 0.1, 0.15, 0.8)
    _close(_reported(m(x), m.max_names), want)
    adv = torch.tensor([1.0, -0.5, 2.0, -1.0], dtype=torch.float64)
    per_token = torch.zeros_like(x.logps)
    for (r, a, b), v in zip(spans, adv):
        per_token[r, a:b] = v
    x.advantages = per_token
    want = grpo_reference(flat(x.logps), flat(x.old_logps), flat(per_token), flat(x.entropy), 0.1, 0.15, 0.8,
                          kind=kind, seqs=lengths)
    got = _reported(m(x), m.max_names)
    _close(got, want)
    assert 0 < want["train/clip_ratio"] < 1     # some clip, some do not: the test tells them apart
    assert m.derive(got) == {"train/policy_confidence": math.exp(got["train/mean_new_logp"])}


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match=r"unknown metric 'AccuracyMetric'; known: \['Accuracy', 'CISPOMetric'"):
        metrics.resolve_metric("AccuracyMetric", {})
    with pytest.raises(TypeError, match=r"add_metric\(DPOMetric\): unknown argument\(s\) \['gamma'\]"):
        metrics.resolve_metric("dpometric", {"gamma": 1.0})
    with pytest.raises(ValueError, match="top_k_kl=4"):
        metrics.GRPOMetric(top_k_kl=4)
    with pytest.raises(ValueError, match="ignore_index=-1"):
        metrics.DPOMetric(ignore_index=-1)
    table = {}
    metrics.register(table, "GRPOMetric", None, needs_entropy=False, is_training=None, kwargs={})
    with pytest.raises(ValueError, match=r"\['train/approx_kl'.* by the metric 'GRPOMetric'"):
        metrics.register(table, metrics.CISPOMetric, None, needs_entropy=False, is_training=None, kwargs={})
    with pytest.raises(TypeError, match="is_training must be None"):
        metrics.register(table, "DPOMetric", None, needs_entropy=False, is_training="yes", kwargs={})
    with pytest.raises(TypeError, match=r"add_metric\(name, fn\): unknown keyword argument\(s\) \['beta'\]"):
        metrics.register(table, "m", lambda x: (0, 0), needs_entropy=False, is_training=None, kwargs={"beta": 1})


# ---- through the facade --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model():
    pytest.importorskip("megatron.core")
    from conftest import megatron_one_rank
    from twinkle_megatron.job.configs import tiny_qwen3_config
    with megatron_one_rank() as tm:
        m = tm.MegatronModel(model_id=tiny_qwen3_config(num_layers=1), mixed_precision="fp32")
        m.set_optimizer("AdamW", lr=1e-3)
        yield m


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (4, 12), generator=g)
    labels = ids.clone()
    for b, p in enumerate([3, 5, 4, 2]):
        labels[b, :p] = -100
    labels[2, 9:] = -100
    mask = labels != -100
    mask[:, 0] = False
    return {"input_ids": ids, "labels": labels}, mask, g


@pytest.mark.multiprocess
def test_dpo_metric_through_calls_and_calculate_metric(model):
    model.set_loss("dpo", beta=0.3)
    model.calculate_metric()
    model.add_metric(metrics.DPOMetric, beta=0.3)     # upstream's class form
    try:
        pis, refs = [], []
        for seed in (1, 2):      # two calls, two micro-batches each: the pooled means
            batch, mask, g = _batch(seed)
            ref = (torch.randn(4, 12, generator=g) * 0.5 - 5.0) * mask
            out = model.forward_backward(inputs=batch, ref_outputs={"logps": ref}, micro_batch_size=2,
                                         return_logps=True)
            pis.append((out["logps"].double() * mask).sum(1))
            refs.append(ref.double().sum(1))
            # the loss's own margin is mean z / beta = the metric's rewards/margins / beta
            assert abs(out["rewards/margins"] / 0.3 - out["margin"]) <= 1e-5 * max(1, abs(out["margin"]))
        model.zero_grad()
        got = model.calculate_metric()
        want = dpo_reference(torch.cat(pis), torch.cat(refs), 0.3)
        _close({k: got[k] for k in want}, want, tol=1e-6)
        assert "loss" in got and "learning rate" in got
    finally:
        del model.train_state().user_metrics["DPOMetric"]
        model.set_loss("cross_entropy")


@pytest.mark.multiprocess
def test_grpo_metric_by_name_training_only(model):
    model.set_loss("grpo", epsilon=0.1, epsilon_high=0.12)
    model.calculate_metric(), model.calculate_metric(is_training=False)
    model.add_metric("GRPOMetric", is_training=True, epsilon=0.1, epsilon_high=0.12)
    try:
        batch, mask, g = _batch(5)
        lp0 = model.forward_only(inputs=batch)["logps"]
        old = (lp0 + 0.3 * torch.randn(4, 12, generator=g)) * mask
        adv = torch.tensor([1.0, -2.0, 0.5, -0.5])
        # two calls, four micro-batches each: means pooled, maxima over every token of both calls
        outs = [model.forward_backward(inputs=batch, old_logps=old * scale, advantages=adv, micro_batch_size=1,
                                       return_logps=True, return_entropy=True) for scale in (1.0, 1.1)]
        model.zero_grad()
        got = model.calculate_metric()
        out = outs[0]
        lp = torch.cat([o["logps"].double()[mask] for o in outs])
        ent = torch.cat([o["entropy"].double()[mask] for o in outs])
        olds = torch.cat([(old * scale).double()[mask] for scale in (1.0, 1.1)])
        advs = (adv[:, None].double() * mask)[mask].repeat(2)
        want = grpo_reference(lp, olds, advs, ent, 0.1, 0.12)
        one = grpo_reference(out["logps"].double()[mask], old.double()[mask], advs[:len(advs) // 2],
                             out["entropy"].double()[mask], 0.1, 0.12)
        assert abs(out["train/token_kl_max"] - one["train/token_kl_max"]) <= 1e-6   # forward_backward's own
        want["train/policy_confidence"] = math.exp(want["train/mean_new_logp"])
        _close({k: got[k] for k in got if k.startswith("train/")}, want, tol=1e-6)
        assert abs(one["train/clip_ratio"] - out["clip_frac"]) <= 1e-6    # the loss's own count agrees
        assert want["train/token_kl_max"] > one["train/token_kl_max"]     # the second call's maximum counts
        assert 0 < got["train/clip_ratio"] < 1 and got["train/entropy"] > 0
        # is_training=True: forward_only calls do not report it
        model.forward_only(inputs=batch)
        assert not any(k.startswith("train/") for k in model.calculate_metric(is_training=False))
    finally:
        del model.train_state().user_metrics["GRPOMetric"]
        model.set_loss("cross_entropy")


@pytest.mark.multiprocess
def test_data_parallel_ranks_pool_means_and_maxima(tmp_path):
    """Two data-parallel ranks, each with half of the rows: both report the metrics of the whole
    batch, means pooled over the ranks' tokens and pairs, maxima over every token (the largest
    token KL on the second rank's rows)."""
    pytest.importorskip("megatron.core")
    from tests.megatron_workers.protocol import ROOT, launch
    from twinkle_megatron.job.configs import tiny_qwen3_config
    from transformers import AutoModelForCausalLM, Qwen3Config
    torch.manual_seed(0)
    path = str(tmp_path / "model")
    AutoModelForCausalLM.from_config(Qwen3Config(**tiny_qwen3_config(num_layers=1))).save_pretrained(path)
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 256, (8, 10), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    labels[5, 8:] = -100
    mask = labels != -100
    mask[:, 0] = False
    data = {"ids": ids, "labels": labels, "adv": torch.randn(8, generator=g),
            "old": (torch.randn(8, 10, generator=g) * torch.tensor([0.2] * 4 + [0.8] * 4)[:, None] - 5.5) * mask,
            "ref": (torch.randn(8, 10, generator=g) * 0.3 - 5.5) * mask}
    torch.save(data, str(tmp_path / "data.pt"))
    spec = {"data": str(tmp_path / "data.pt"), "model_dir": path, "runs": [{"name": "dp2", "mesh": {"dp_size": 2}}]}
    res, rcs, logs, _ = launch(2, spec, str(tmp_path / "run"), timeout=300,
                               script=os.path.join(ROOT, "tests", "megatron_workers", "metrics_worker.py"))
    assert rcs == [0, 0] and all(r is not None for r in res), "\n".join(l[-3000:] for l in logs)
    recs = [r["dp2"] for r in res]
    for r in recs:
        assert r["ok"], r.get("traceback")
    by_rank = sorted(recs, key=lambda r: r["rows"][0])
    assert [r["rows"] for r in by_rank] == [[0, 4], [4, 8]]
    lp = [torch.cat([torch.tensor(r["grpo_logps"][c]) for r in by_rank]).double() for c in (0, 1)]
    want = grpo_reference(torch.cat([l[mask] for l in lp]),
                          torch.cat([(data["old"] * s).double()[mask] for s in (1.0, 1.2)]),
                          (data["adv"][:, None].double() * mask)[mask].repeat(2), None, 0.1, 0.1)
    want["train/policy_confidence"] = math.exp(want["train/mean_new_logp"])
    pi = (torch.cat([torch.tensor(r["dpo_logps"]) for r in by_rank]).double() * mask).sum(1)
    want_dpo = dpo_reference(pi, data["ref"].double().sum(1), 0.2)
    m0 = mask[:4]
    first = grpo_reference(torch.cat([l[:4][m0] for l in lp]),
                           torch.cat([(data["old"][:4] * s).double()[m0] for s in (1.0, 1.2)]), None, None, 0.1, 0.1)
    assert first["train/token_kl_max"] < want["train/token_kl_max"]
    for r in recs:
        _close({k: v for k, v in r["grpo"].items() if k.startswith("train/")}, want, tol=1e-6)
        _close({k: r["dpo"][k] for k in want_dpo}, want_dpo, tol=1e-6)
